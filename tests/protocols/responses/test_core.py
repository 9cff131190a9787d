"""The Responses core on plain values: items -> messages, plans, events, the bounded store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenwire.engine.admission import Limits
from tokenwire.engine.request import FinishEvent, TokenEvent
from tokenwire.protocols.openai import core as chat_core
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.responses import core
from tokenwire.protocols.responses.events import EventStream
from tokenwire.protocols.responses.schemas import ResponseCreate
from tokenwire.protocols.responses.store import ResponseStore, Stored, owner_of

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}


@pytest.fixture(scope="module")
def tok(smollm2_source: Any) -> Any:
    return smollm2_source.tokenizer


@pytest.fixture(scope="module")
def limits(tok: Any) -> chat_core.ModelLimits:
    engine = Limits(vocab_size=tok.vocab_size, max_model_len=8192, kv_blocks=1024, kv_block_size=16)
    return chat_core.ModelLimits(
        "m", tok, 8192, tok.vocab_size, tok.vocab_size, frozenset(tok.eos_token_ids), engine
    )


def body(**fields: Any) -> ResponseCreate:
    return ResponseCreate(**{"model": "m", "input": "Hi", **fields})


def test_input_items_become_chat_messages() -> None:
    items = core.input_items(
        body(
            input=[
                {"role": "user", "content": "Weather in Rome and Oslo?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Rome"}',
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]},
            ]
        )
    )
    assert [i["type"] for i in items] == [
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert all(i["id"] for i in items)
    messages = core.items_to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert core.input_items(body(input="Hi"))[0]["content"] == [{"type": "input_text", "text": "Hi"}]


@pytest.mark.parametrize(
    ("given", "param"),
    [
        ([{"type": "item_reference", "id": "x"}], "input.0.type"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "input.0.content.0.type",
        ),
        ([{"role": "robot", "content": "x"}], "input.0.role"),
        ([{"type": "function_call_output", "output": "x"}], "input.0.call_id"),
        ([], "input"),
    ],
)
def test_bad_input_items_name_the_field(given: list[Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        core.input_items(body(input=given))
    assert (err.value.status, err.value.param) == (400, param)


def test_chat_errors_name_the_responses_field(limits: chat_core.ModelLimits) -> None:
    with pytest.raises(OpenAIError) as err:  # SmolLM2's template cannot show tools: as chat, 400
        core.plan_turn(body(tools=[WEATHER]), limits, None, [], None)
    assert err.value.param == "tool_choice"
    fmt = {"format": {"type": "json_object"}}
    with pytest.raises(OpenAIError) as err:
        core.plan_turn(body(tools=[WEATHER], tool_choice="required", text=fmt), limits, None, [], None)
    assert err.value.param in ("text.format", "tool_choice") and "response_format" not in err.value.message


def test_a_continuation_appends_only_the_new_turn(tok: Any, limits: chat_core.ModelLimits) -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    session = (
        tok.apply_chat_template(first) + tok.encode("Hi!", add_special_tokens=False) + tok.eos_token_ids[:1]
    )
    previous = {"output": []}
    turn = core.plan_turn(body(input="And you?"), limits, previous, [], session)
    full = tok.apply_chat_template(
        [*first, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "And you?"}]
    )
    assert session + turn.plan.prompts[0] == full
    fresh = core.plan_turn(body(input="Hello", instructions="Be brief."), limits, None, [], None)
    assert fresh.plan.prompts[0] == tok.apply_chat_template(first)


def _feed(turn: core.Turn, tok: Any, text: str, reason: str = "eos") -> list[dict[str, Any]]:
    stream = EventStream(turn)
    events = stream.start()
    ids = tok.encode(text, add_special_tokens=False)
    for k, token in enumerate(ids):
        events += stream.text(turn.out.feed(TokenEvent(token, 10 + k, False, text=tok.decode([token]))).text)
    turn.out.feed(FinishEvent(reason, 10, len(ids)))
    return events + stream.end()


def test_streamed_text_events(tok: Any, limits: chat_core.ModelLimits) -> None:
    turn = core.plan_turn(body(), limits, None, [], None)
    events = _feed(turn, tok, "Hello there, friend")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == "Hello there, friend" == final["output"][0]["content"][0]["text"]
    assert final["output"][0]["id"] == events[2]["item"]["id"] and final["status"] == "completed"
    assert (
        final["usage"]["input_tokens"] == 10
        and final["usage"]["total_tokens"] == 10 + final["usage"]["output_tokens"]
    )


def test_a_cut_response_is_incomplete(tok: Any, limits: chat_core.ModelLimits) -> None:
    turn = core.plan_turn(body(max_output_tokens=3), limits, None, [], None)
    events = _feed(turn, tok, "One two three", reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_named_function_streams_its_arguments(tok: Any, limits: chat_core.ModelLimits) -> None:
    named = {"type": "function", "name": "get_weather"}
    turn = core.plan_turn(body(tools=[WEATHER], tool_choice=named), limits, None, [], None)
    events = _feed(turn, tok, '{"city": "Rome"}')
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds and kinds[2] == "response.output_item.added"
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and len(kinds[3:-3]) > 1
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-1]["response"]["output"][0]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "get_weather",
        {"city": "Rome"},
    )
    assert "".join(e["delta"] for e in events[3:-3]) == call["arguments"]
    assert events[2]["item"]["call_id"] == call["call_id"] and events[2]["item"]["id"] == call["id"]


def test_a_required_call_is_sent_once_parsed(tok: Any, limits: chat_core.ModelLimits) -> None:
    turn = core.plan_turn(body(tools=[WEATHER], tool_choice="required"), limits, None, [], None)
    events = _feed(turn, tok, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-1]["response"]["output"][0]
    assert json.loads(events[3]["delta"]) == json.loads(call["arguments"]) == {"city": "Oslo"}
    assert events[2]["item"]["call_id"] == call["call_id"]


def test_a_cut_named_call_is_incomplete(tok: Any, limits: chat_core.ModelLimits) -> None:
    named = {"type": "function", "name": "get_weather"}
    turn = core.plan_turn(
        body(tools=[WEATHER], tool_choice=named, max_output_tokens=2), limits, None, [], None
    )
    events = _feed(turn, tok, '{"city', reason="length")
    [call] = events[-1]["response"]["output"]
    assert (call["type"], call["status"], events[-1]["type"]) == (
        "function_call",
        "incomplete",
        "response.incomplete",
    )


def test_the_previous_output_sent_again_is_not_repeated(limits: chat_core.ModelLimits, tok: Any) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "fc_1"}
    said = {"type": "message", "role": "assistant", "content": "Let me check.", "id": "msg_1"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    session = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    previous = {"output": [said, {**call, "id": "fc_other"}]}
    both = core.plan_turn(body(input=[said, call, output]), limits, previous, [], session)
    only = core.plan_turn(body(input=[output]), limits, previous, [], session)
    assert both.plan.prompts == only.plan.prompts and len(both.items) == 3


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _stored(rid: str, owner: str = "a") -> Stored:
    return Stored(rid, owner, f"s-{rid}", {"id": rid, "output": []}, [])


def test_store_ownership_lru_and_ttl() -> None:
    closed: list[str] = []
    clock = Clock()
    store = ResponseStore(2, 60.0, closed.append, clock)
    store.put(_stored("r1", owner_of("key-a")))
    with pytest.raises(OpenAIError) as err:  # another key's response reads as absent
        store.get("r1", owner_of("key-b"), "previous_response_id")
    assert (err.value.status, err.value.param, err.value.code) == (
        404,
        "previous_response_id",
        "previous_response_not_found",
    )
    assert store.get("r1", owner_of("key-a")).id == "r1"
    store.put(_stored("r2"))
    store.get("r1", owner_of("key-a"))  # r2 is now the least recently used
    store.put(_stored("r3"))
    assert closed == ["s-r2"] and len(store) == 2
    clock.now = 61.0
    store.expire()
    assert sorted(closed) == ["s-r1", "s-r2", "s-r3"] and len(store) == 0
    store.put(_stored("r4"))
    store.delete("r4", "a")
    with pytest.raises(OpenAIError):
        store.get("r4", "a")
    assert closed[-1] == "s-r4"


def test_evict_oldest_keeps_the_one_being_continued() -> None:
    closed: list[str] = []
    store = ResponseStore(8, None, closed.append)
    store.put(_stored("r1"))
    assert not store.evict_oldest(keep="r1") and closed == []
    store.put(_stored("r2"))
    assert store.evict_oldest(keep="r1") and closed == ["s-r2"]
