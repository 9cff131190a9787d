"""The official `openai` client against a live `tokenwire serve` on SmolLM2, checked against the
engine itself (same model, in this process) wherever the API promises the engine's answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.protocols.openai.conftest import MODEL
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def engine_greedy(
    engine: Any, tokens: list[int], max_tokens: int, top: int = 0
) -> tuple[list[TokenEvent], FinishEvent]:
    options = GenerateOptions(
        max_tokens=max_tokens, sampling=SamplingParams(temperature=0), logprobs=True, top_logprobs=top
    )
    return engine.generate(None, tokens, options).result()


def text_of(engine: Any, events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events if e.token_id not in engine.eos_ids)


def chat_prompt(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_models_list_names_the_loaded_model(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["context_length"] == 8192
    assert client.models.retrieve(MODEL).id == MODEL


def test_greedy_chat_equals_the_engine_and_counts_usage(client: Any, smollm2_engine: Any) -> None:
    prompt = chat_prompt(smollm2_engine, QUESTION)
    events, finish = engine_greedy(smollm2_engine, prompt, 24)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text_of(smollm2_engine, events)
    assert choice.finish_reason == ("stop" if finish.reason == "eos" else "length")
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(events)
    assert reply.usage.total_tokens == len(prompt) + len(events)
    assert reply.model == MODEL and reply.object == "chat.completion"


def test_streamed_chat_equals_unstreamed_with_usage_last(client: Any) -> None:
    args = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_and_top_logprobs_equal_the_engine(client: Any, smollm2_engine: Any) -> None:
    events, _ = engine_greedy(smollm2_engine, chat_prompt(smollm2_engine, QUESTION), 8, top=3)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    visible = [e for e in events if e.token_id not in smollm2_engine.eos_ids]
    assert len(content) == len(visible)
    tok = smollm2_engine.tokenizer
    for entry, event in zip(content, visible, strict=True):
        assert bytes(entry.bytes) == tok.token_bytes(event.token_id)
        assert entry.logprob == pytest.approx(event.logprob, abs=1e-4)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [
            tok.token_bytes(t) for t, _ in event.top_logprobs
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in event.top_logprobs], abs=1e-4
        )


def test_seed_reproduces_and_n_gives_distinct_choices(client: Any) -> None:
    args = dict(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=16, seed=1234, n=2)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.choices[0].message.content != first.choices[1].message.content  # seeds 1234 and 1235
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # the prompt counts once
    single = client.chat.completions.create(**{**args, "n": 1})
    assert single.choices[0].message.content == first.choices[0].message.content


def test_stop_string_ends_the_output_before_it(client: Any, smollm2_engine: Any) -> None:
    full = text_of(
        smollm2_engine, engine_greedy(smollm2_engine, chat_prompt(smollm2_engine, QUESTION), 24)[0]
    )
    words = full.split(" ")
    assert len(words) > 3, full
    stop = " " + words[2]  # the third word, found mid-output
    expected = full[: full.index(stop)]
    args = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop, "NEVER-SEEN"])
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
    )
    assert streamed == expected


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def check_person(obj: Any) -> None:
    """The schema above, checked by hand (every keyword it uses)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "city"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 24
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert obj["city"] in ("Paris", "Rome", "Oslo")


def test_response_format_json_schema_output_validates(client: Any, smollm2_engine: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        temperature=0.8,
        seed=3,
        max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    check_person(json.loads(reply.choices[0].message.content))
    # json_object: any JSON object. A strong bias for "}" ends it as soon as the grammar allows
    # (unconstrained, the bias alone would give "}}}...")
    (brace,) = smollm2_engine.tokenizer.encode("}", add_special_tokens=False)
    obj = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=20,
        messages=[{"role": "user", "content": "Give me a JSON object with your name."}],
        response_format={"type": "json_object"},
        logit_bias={str(brace): 30},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": PERSON},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_named_function_call_parses_against_its_schema(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        temperature=0.7,
        seed=5,
        max_tokens=80,
        tools=[WEATHER, TIME],
        messages=[{"role": "user", "content": "What's the weather like for Anna, 30, in Rome?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_person(json.loads(call.function.arguments))
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            temperature=0.7,
            seed=5,
            max_tokens=80,
            tools=[WEATHER, TIME],
            stream=True,
            messages=[{"role": "user", "content": "What's the weather like for Anna, 30, in Rome?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    deltas = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.function.arguments for d in deltas] == [call.function.arguments]


def test_required_tool_choice_calls_one_of_the_tools(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=80,
        tools=[WEATHER, TIME],
        tool_choice="required",
        messages=[{"role": "user", "content": "What time is it in UTC?"}],
    )
    (call,) = reply.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert args["zone"] in ("UTC", "CET") and set(args) == {"zone"}
    else:
        assert call.function.name == "get_weather"
        check_person(args)


def test_completions_text_tokens_echo_and_legacy_logprobs(client: Any, smollm2_engine: Any) -> None:
    tok = smollm2_engine.tokenizer
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    events, _ = engine_greedy(smollm2_engine, ids, 6, top=1)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert reply.choices[0].text == text_of(smollm2_engine, events)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[prompt, "Hello"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == reply.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tok.encode("Hello"))
    echo = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1
    )
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == prompt + reply.choices[0].text
    assert len(lp.tokens) == len(ids) + len(events)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts token 0
    generated = lp.token_logprobs[len(ids) :]
    assert generated == pytest.approx([e.logprob for e in events], abs=1e-4)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_a_session_turn_costs_only_its_new_tokens_and_equals_resending(client: Any) -> None:
    session = client.post("/sessions", body={}, cast_to=object)["id"]
    turn1 = [{"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(
        model=MODEL, messages=turn1, temperature=0, max_tokens=20, extra_body={"session": session}
    )
    reply1 = first.choices[0].message.content
    turn2 = [{"role": "user", "content": "Now name three animals."}]
    second = client.chat.completions.create(
        model=MODEL, messages=turn2, temperature=0, max_tokens=20, extra_body={"session": session}
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    history = [*turn1, {"role": "assistant", "content": reply1}, *turn2]
    resent = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=20)
    assert second.choices[0].message.content == resent.choices[0].message.content
    assert second.usage.prompt_tokens == resent.usage.prompt_tokens  # the very same tokens
    # the session holds both turns: its text is the whole conversation
    state = client.get(f"/sessions/{session}", cast_to=object)
    assert state["length"] == second.usage.prompt_tokens + second.usage.completion_tokens
    assert "Now name three animals." in state["text"] and reply1 in state["text"]
    client.delete(f"/sessions/{session}", cast_to=object)
