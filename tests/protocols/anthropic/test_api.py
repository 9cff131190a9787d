"""Anthropic's Messages API on a served SmolLM2 through the real `anthropic` client: text,
streaming, tools, structured output, counting, greedy parity with OpenAI's chat on the same
server. (This SDK has no temperature argument: sampling fields go as raw body fields.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.protocols.openai.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow
GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_create_answers_with_a_text_block_and_usage(client: Any) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=24,
        system=[{"type": "text", "text": "Answer in one sentence."}],
        messages=QUESTION,
        metadata={"user_id": "u-1"},
        **GREEDY,
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens > 0


def test_the_async_client_and_the_stream_give_the_greedy_text(client: Any, root: str) -> None:
    expected = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, **GREEDY).content[0].text

    async def run() -> tuple[Any, str]:
        async_client = anthropic.AsyncAnthropic(base_url=root, api_key=API_KEY, max_retries=0)
        message = await async_client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, **GREEDY)
        async with async_client.messages.stream(
            model=MODEL, max_tokens=16, messages=QUESTION, **GREEDY
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
        return message, text

    message, streamed = asyncio.run(run())
    assert message.content[0].text == streamed == expected
    with client.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens > 0


def test_the_raw_stream_is_named_events(root: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{root}/v1/messages", json=body, headers=headers, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [data["type"] for data in datas]  # every event named as its type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 4


def test_greedy_parity_with_openai_chat_on_the_same_server(client: Any, root: str) -> None:
    system = "You are a helpful assistant."
    turns = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Name another one."},
    ]
    ours = client.messages.create(model=MODEL, max_tokens=20, system=system, messages=turns, **GREEDY)
    oai = openai.OpenAI(base_url=f"{root}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    theirs = oai.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0, messages=[{"role": "system", "content": system}, *turns]
    )
    assert ours.content[0].text == theirs.choices[0].message.content
    assert ours.usage.output_tokens == theirs.usage.completion_tokens
    prompt = ours.usage.input_tokens + ours.usage.cache_read_input_tokens
    assert prompt == theirs.usage.prompt_tokens


def test_a_stop_sequence_ends_the_answer_before_it(client: Any) -> None:
    full = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, **GREEDY).content[0].text
    word = full.split()[2]  # a word inside the greedy answer
    stops = ["zq1", "zq2", "zq3", "zq4", word]  # more than OpenAI's 4
    message = client.messages.create(
        model=MODEL, max_tokens=16, messages=QUESTION, stop_sequences=stops, **GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == full[: full.index(word)]


def test_a_tool_use_and_tool_result_round_trip(client: Any) -> None:
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    call = client.messages.create(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,
        **GREEDY,
    )
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert isinstance(block.input["city"], str)
    result = {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 25 degrees"}
    answer = client.messages.create(
        model=MODEL,
        max_tokens=30,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            *ask,
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [result]},
        ],
        **GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content[0].type == "text" and answer.content[0].text


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_streamed_tool_call_arrives_as_input_json_deltas(client: Any, choice: dict[str, Any]) -> None:
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    with client.messages.stream(
        model=MODEL, max_tokens=40, tools=[WEATHER], tool_choice=choice, messages=ask, **GREEDY
    ) as stream:
        partial = "".join(
            event.delta.partial_json
            for event in stream
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    (block,) = final.content
    assert final.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "get_weather"
    assert json.loads(partial) == block.input and isinstance(block.input["city"], str)


def test_a_json_constrained_answer_through_a_tool_schema(client: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "country": {"type": "string"},
            "capital": {"type": "string"},
            "rank": {"type": "integer"},
        },
        "required": ["country", "capital", "rank"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=MODEL,
        max_tokens=60,
        tools=[{"name": "record", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "record"},
        messages=[{"role": "user", "content": "Record France and its capital."}],
        **GREEDY,
    )
    data = message.content[0].input
    assert set(data) == {"country", "capital", "rank"} and isinstance(data["rank"], int)


def test_output_config_format_constrains_the_text(client: Any) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=QUESTION,
        **GREEDY,
    )
    assert isinstance(json.loads(message.content[0].text)["capital"], str)


def test_count_tokens_is_the_prompt_a_create_uses(client: Any) -> None:
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=QUESTION)
    usage = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=QUESTION).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_requests_are_labelled_anthropic_on_metrics(client: Any, root: str) -> None:
    client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    text = httpx.get(f"{root}/metrics", timeout=30).text
    assert any(
        line.startswith("tokenwire_requests_total{") and 'protocol="anthropic"' in line
        for line in text.splitlines()
    )
