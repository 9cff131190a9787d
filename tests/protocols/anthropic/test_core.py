"""The sans-IO core of the Anthropic Messages API on plain values: request bodies -> the OpenAI
side's chat request, engine events -> Anthropic's message and stream events, errors -> its
shape. No model, no server."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tokenwire.engine.request import FinishEvent, TokenEvent
from tokenwire.engine.vision import ImageBlock
from tokenwire.protocols.anthropic import core
from tokenwire.protocols.anthropic.errors import AnthropicError, from_openai
from tokenwire.protocols.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenwire.protocols.openai.core import ModelLimits, Plan
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.images import ChatVision
from tokenwire.protocols.openai.output import ChoiceOutput

EOS = 2
TEXT_ONLY = ModelLimits("m", None, 64, 100, 100, frozenset({EOS}), None)  # type: ignore[arg-type]
VISION = ModelLimits(
    "m", None, 64, 100, 100, frozenset({EOS}), None,  # type: ignore[arg-type]
    vision=ChatVision(ImageBlock(90, 91, 92, lambda data, mime: 4)),
)  # fmt: skip
USER = {"role": "user", "content": "Hi"}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [USER], **fields}


def refused(model: Any, given: dict[str, Any]) -> str:
    with pytest.raises(AnthropicError) as info:
        core.parse(model, given)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value.message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 1.5}, "temperature"),  # Anthropic's range is 0..1
        ({"top_p": 0}, "top_p"),
        ({"top_k": False}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(fields: dict[str, Any], named: str) -> None:
    given = {k: v for k, v in body(**fields).items() if v is not None}
    assert refused(MessagesRequest, given).startswith(named)


def test_the_body_must_be_an_object() -> None:
    assert "JSON object" in refused(MessagesRequest, [1, 2])  # type: ignore[arg-type]


def test_count_tokens_takes_no_sampling_fields() -> None:
    assert refused(CountTokensRequest, body()).startswith("max_tokens")
    core.parse(CountTokensRequest, {"model": "m", "messages": [USER]})


def test_system_blocks_and_tool_blocks_become_openai_chat_messages() -> None:
    req = core.parse(
        MessagesRequest,
        body(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {}}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Rome"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "Sun"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": "down",
                            "is_error": True,
                        },
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
            tools=[{"name": "weather", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
            stop_sequences=["a", "b", "c", "d", "e"],  # more than OpenAI's 4
            temperature=0,
            top_k=3,
        ),
    )
    chat = core._chat_body(req, TEXT_ONLY)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sun"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    ]
    assert chat["tool_choice"] == "required"
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    core._chat_request(chat)  # the OpenAI side takes it as it is


@pytest.mark.parametrize(
    ("choice", "openai"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice_maps_to_openai(choice: dict[str, Any], openai: Any) -> None:
    req = core.parse(MessagesRequest, body(tools=[{"name": "f", "input_schema": {}}], tool_choice=choice))
    assert core._chat_body(req, TEXT_ONLY)["tool_choice"] == openai


def test_output_config_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = core.parse(
        MessagesRequest, body(output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert core._chat_body(req, TEXT_ONLY)["response_format"]["json_schema"]["schema"] == schema


def test_images_need_a_vision_model_and_base64() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    req = core.parse(MessagesRequest, body(messages=[{"role": "user", "content": [image]}]))
    with pytest.raises(AnthropicError, match="need a vision model"):
        core._chat_body(req, TEXT_ONLY)
    part = core._chat_body(req, VISION)["messages"][0]["content"][0]
    assert part == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    req = core.parse(MessagesRequest, body(messages=[{"role": "user", "content": [remote]}]))
    with pytest.raises(AnthropicError, match="does not fetch remote images"):
        core._chat_body(req, VISION)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "'document' block"),
        ([{"role": "assistant", "content": [{"type": "image", "source": {}}]}, USER], "'image' block"),
        ([USER, {"role": "assistant", "content": "The answer is"}], "prefill"),
    ],
)
def test_what_cannot_be_served_is_refused(messages: list[Any], match: str) -> None:
    req = core.parse(MessagesRequest, body(messages=messages))
    with pytest.raises(AnthropicError, match=match):
        core._chat_body(req, TEXT_ONLY)


def test_extended_thinking_is_refused() -> None:
    req = core.parse(MessagesRequest, body(thinking={"type": "enabled", "budget_tokens": 1024}))
    with pytest.raises(AnthropicError, match="thinking"):
        core._chat_body(req, TEXT_ONLY)


@pytest.mark.parametrize(
    ("status", "kind", "sent"),
    [
        (400, "invalid_request_error", 400),
        (404, "not_found_error", 404),
        (409, "invalid_request_error", 409),
        (429, "rate_limit_error", 429),
        (500, "api_error", 500),
        (503, "overloaded_error", 529),  # shutting down: Anthropic's retryable status
    ],
)
def test_openai_errors_keep_their_message_in_anthropics_shape(status: int, kind: str, sent: int) -> None:
    error = from_openai(OpenAIError(status, "went wrong", param="messages"))
    assert error.status == sent
    assert error.body()["type"] == "error" and error.body()["error"]["type"] == kind
    assert error.body()["error"]["message"].endswith("went wrong")


# ------------------------------------------------------------------------------ responses
def plan(*, stops: list[str] | None = None, mode: str = "none") -> Plan:
    out = ChoiceOutput(0, None, frozenset({EOS}), stops=stops or [], ignore_eos=False, legacy_logprobs=False)  # type: ignore[arg-type]
    return Plan("chat", "m", None, [[1, 2, 3, 4]], [], [out], True, False, id="msg_1", tool_mode=mode)


def token(text: str, position: int, token_id: int = 7) -> TokenEvent:
    return TokenEvent(token_id, position, False, text=text)


def run(p: Plan, events: list[Any], cached: int = 0) -> list[dict[str, Any]]:
    stream = core.EventStream(p)
    out = stream.start()
    p.outputs[0].cached_tokens = cached
    for event in events:
        out += stream.feed(event)
    return out


def test_a_text_stream_is_anthropics_event_sequence_and_matches_the_message() -> None:
    p = plan()
    finish = FinishEvent("eos", prompt_tokens=4, completion_tokens=3)
    events = run(p, [token("Hel", 4), token("lo", 5), token("", 6, EOS), finish], cached=2)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0]["message"]["usage"]["input_tokens"] == 4
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hello"
    usage = {
        "input_tokens": 2,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2,
    }
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": usage,
    }
    message = core.message_response(p)
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["stop_reason"] == "end_turn" and message["usage"] == usage


def test_a_stop_sequence_is_cut_and_named() -> None:
    p = plan(stops=["END"])
    finish = FinishEvent("stop", prompt_tokens=4, completion_tokens=2)
    events = run(p, [token("ab E", 4), token("ND", 5), finish])
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "ab "
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_max_tokens_is_the_stop_reason_when_the_budget_ends_it() -> None:
    p = plan()
    events = run(p, [token("a", 4), FinishEvent("length", prompt_tokens=4, completion_tokens=1)])
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_an_empty_answer_has_no_blocks() -> None:
    p = plan()
    events = run(p, [token("", 4, EOS), FinishEvent("eos", prompt_tokens=4, completion_tokens=1)])
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]
    assert core.message_response(p)["content"] == []


def test_a_required_tool_call_goes_out_whole_as_tool_use() -> None:
    p = plan(mode="required")
    p.tool_names = {"weather"}
    text = '{"name": "weather", "arguments": {"city": "Rome"}}'
    events = run(p, [token(text, 4), FinishEvent("stop", prompt_tokens=4, completion_tokens=9)])
    types = [e["type"] for e in events]
    assert types[2:] == [
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    block = events[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "weather" and block["input"] == {}
    assert block["id"].startswith("toolu_")
    assert events[3]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    message = core.message_response(p)
    assert message["content"][0]["input"] == {"city": "Rome"} and message["stop_reason"] == "tool_use"


def test_a_named_tools_arguments_stream_as_they_are_generated() -> None:
    from tokenwire.protocols.openai.schemas import Tool

    p = plan(mode="named")
    p.tool = Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": {}}})
    p.tool_names = {"weather"}
    pieces = ['{"city"', ': "Rome"}']
    finish = FinishEvent("stop", prompt_tokens=4, completion_tokens=2)
    events = run(p, [token(pieces[0], 4), token(pieces[1], 5), finish])
    assert events[2]["content_block"]["name"] == "weather"
    deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == pieces
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
