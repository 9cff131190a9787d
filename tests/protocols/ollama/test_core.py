"""The sans-IO core of Ollama's API with plain values: options, plans, replies, listings."""

from __future__ import annotations

from typing import Any

import pytest

from tokenwire.engine.admission import Limits
from tokenwire.engine.request import FinishEvent, TokenEvent
from tokenwire.protocols.ollama import core, info
from tokenwire.protocols.ollama.errors import OllamaError
from tokenwire.protocols.ollama.options import DEFAULT_TEMPERATURE, parse_options, room
from tokenwire.protocols.ollama.reply import Reply
from tokenwire.protocols.openai.core import ModelLimits

M = "m"


@pytest.fixture(scope="module")
def tok(smollm2_source: Any) -> Any:
    return smollm2_source.tokenizer


@pytest.fixture(scope="module")
def limits(tok: Any) -> ModelLimits:
    engine = Limits(vocab_size=tok.vocab_size, max_model_len=512, kv_blocks=1024, kv_block_size=16)
    return ModelLimits(M, tok, 512, tok.vocab_size, tok.vocab_size, frozenset(tok.eos_token_ids), engine)


def refused(call: Any, *args: Any) -> OllamaError:
    with pytest.raises(OllamaError) as caught:
        call(*args)
    return caught.value


# ---------------------------------------------------------------------------------- options
def test_options_default_to_ollamas_and_map_onto_the_engine() -> None:
    default = parse_options(None)
    assert (default.sampling.temperature, default.sampling.top_k, default.sampling.top_p) == (
        DEFAULT_TEMPERATURE,
        40,
        0.9,
    )
    assert default.num_predict is None and default.sampling.seed is None
    given = parse_options(
        {"temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 7, "num_predict": 5, "stop": ["x"], "num_gpu": 9}
    )
    assert (given.sampling.temperature, given.sampling.top_p, given.sampling.top_k) == (0, 0.5, 3)
    assert (given.sampling.seed, given.num_predict, given.stop) == (7, 5, ["x"])
    assert parse_options({"seed": -1}).sampling.seed is None  # Ollama's "random"
    assert parse_options({"num_predict": -2}).num_predict is None  # "fill the context"
    assert parse_options({"repeat_penalty": 1.0}).sampling.temperature == DEFAULT_TEMPERATURE


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"temperature": float("nan")}, "options.temperature must be a finite number"),
        ({"top_k": True}, "options.top_k must be an integer"),
        ({"seed": 2**64}, "options.seed must be in 0..2**64-1"),
        ({"top_p": 2}, "options.top_p"),
        ({"num_predict": -3}, "options.num_predict"),
        ({"repeat_penalty": 1.1}, "options.repeat_penalty is not supported"),
        ({"mirostat": 2}, "options.mirostat is not supported"),
        ({"bogus": 1}, "options.bogus is not a known option"),
        ({"stop": [1]}, "options.stop"),
        ({"stop": ["x" * 1025]}, "options.stop takes at most"),
        ("hot", "options must be an object"),
    ],
)
def test_bad_options_are_400s_naming_the_option(options: Any, words: str) -> None:
    error = refused(parse_options, options)
    assert error.status == 400 and words in error.message


def test_num_ctx_caps_the_room_and_names_itself() -> None:
    assert room(parse_options({"num_ctx": 100}), 40, 512) == 60
    assert room(parse_options({"num_ctx": 4096, "num_predict": 10}), 40, 512) == 10
    assert "options.num_ctx 30" in refused(room, parse_options({"num_ctx": 30}), 40, 512).message


# ---------------------------------------------------------------------------------- plans
def test_chat_plans_the_chat_template_and_echoes_the_model(tok: Any, limits: ModelLimits) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    request = core.plan_chat({"model": f"{M}:latest", "messages": messages}, limits)
    assert request.model == f"{M}:latest" and request.stream
    assert request.plan is not None and request.plan.prompts == [tok.apply_chat_template(messages)]
    options = request.plan.choices[0][1]
    assert options.max_tokens == 512 - len(request.prompt)


def test_generate_continues_a_context_as_the_conversation(tok: Any, limits: ModelLimits) -> None:
    turn1 = [{"role": "user", "content": "Hello there"}]
    context = [
        *tok.apply_chat_template(turn1),
        *tok.encode("Hi!", add_special_tokens=False),
        *tok.eos_token_ids[:1],
    ]
    request = core.plan_generate({"model": M, "prompt": "Again", "context": context, "stream": False}, limits)
    full = tok.apply_chat_template(
        [*turn1, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again"}]
    )
    assert request.prompt == full and not request.stream


def test_raw_generate_is_the_text_as_tokenized(tok: Any, limits: ModelLimits) -> None:
    request = core.plan_generate({"model": M, "prompt": "2 + 2 =", "raw": True}, limits)
    assert request.prompt == tok.encode("2 + 2 =")


def test_nothing_to_generate_is_a_load(limits: ModelLimits) -> None:
    request = core.plan_generate({"model": M}, limits)
    assert request.plan is None
    assert Reply(request).final()["done_reason"] == "load"
    unload = core.plan_chat({"model": M, "messages": [], "keep_alive": 0}, limits)
    assert Reply(unload).final()["done_reason"] == "unload"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"prompt": "x"}, 400, "model is required"),
        ({"model": "other", "prompt": "x"}, 404, 'model "other" not found'),
        ({"model": M, "prompt": "x", "format": "yaml"}, 400, "format must be"),
        ({"model": M, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template is not supported"),
        ({"model": M, "prompt": "x", "context": [1, -1]}, 400, "context: a token id"),
        ({"model": M, "prompt": "x", "context": [True]}, 400, "context: a token id"),
        ({"model": M, "prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
        ({"model": M, "prompt": "x", "think": True}, 400, "does not support thinking"),
        ({"model": M, "prompt": "x", "top_logprobs": 2}, 400, "needs logprobs"),
        ({"model": M, "prompt": " ".join(map(str, range(600))), "raw": True}, 400, "context"),
        ({"model": M, "prompt": "x", "format": {"type": "nonsense"}}, 400, "format"),
    ],
)
def test_bad_generate_requests(limits: ModelLimits, body: dict[str, Any], status: int, words: str) -> None:
    error = refused(core.plan_generate, body, limits)
    assert error.status == status and words in error.message, error.message


def test_bad_chat_messages(limits: ModelLimits) -> None:
    assert (
        "messages[0].role"
        in refused(core.plan_chat, {"model": M, "messages": [{"role": "x"}]}, limits).message
    )
    images = {"model": M, "messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}
    assert "text only" in refused(core.plan_chat, images, limits).message
    tools = {
        "model": M,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"function": {"name": "f"}}],
    }
    assert "does not support tools" in refused(core.plan_chat, tools, limits).message  # SmolLM2's template


# ---------------------------------------------------------------------------------- replies
def test_a_reply_streams_text_and_ends_with_counts_and_durations(limits: ModelLimits) -> None:
    body = {"model": M, "prompt": "Hi", "options": {"stop": ["!"]}}
    request = core.plan_generate(body, limits)
    ticks = iter(range(0, 10**6, 100))
    reply = Reply(request, clock=lambda: next(ticks))
    reply.submit()
    n = len(request.prompt)
    lines = [
        reply.feed(TokenEvent(5, n - 1, True)),
        reply.feed(TokenEvent(17, n, False, text="Hey")),
        reply.feed(TokenEvent(18, n + 1, False, text=" you!")),
        reply.feed(FinishEvent("stop", n, 2)),
    ]
    assert [line and line["response"] for line in lines] == [None, "Hey", " you", None]
    final = reply.final()
    assert final["done"] and final["done_reason"] == "stop" and final["response"] == ""
    assert final["context"] == [*request.prompt, 17, 18]
    assert (final["prompt_eval_count"], final["eval_count"]) == (n, 2)
    assert (
        final["total_duration"]
        == final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"]
    )
    assert all(final[k] >= 0 for k in ("load_duration", "prompt_eval_duration", "eval_duration"))


def test_a_whole_chat_reply(limits: ModelLimits) -> None:
    body = {"model": M, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    request = core.plan_chat(body, limits)
    reply = Reply(request)
    reply.feed(TokenEvent(17, 40, False, text="Hello"))
    reply.feed(TokenEvent(limits.tokenizer.eos_token_ids[0], 41, False))
    reply.feed(FinishEvent("eos", 40, 2))
    final = reply.final()
    assert final["message"] == {"role": "assistant", "content": "Hello"} and final["done_reason"] == "stop"
    assert "context" not in final


# ---------------------------------------------------------------------------------- listings
def test_listings_name_the_model_with_its_tag(limits: ModelLimits) -> None:
    model = info.ModelInfo(
        name=core.served_name(limits),
        family="llama",
        format="gguf",
        size=10,
        parameters=135 * 10**6,
        context_length=512,
        embedding_length=576,
        block_count=30,
        template="",
        tools=False,
        gpu=False,
        modified_at="2026-01-01T00:00:00Z",
    )
    assert info.tags(model)["models"][0]["name"] == f"{M}:latest"
    assert info.ps(model)["models"][0]["details"]["parameter_size"] == "135M"
    shown = info.show({"model": M}, model, limits)
    assert shown["model_info"]["llama.context_length"] == 512 and shown["capabilities"] == ["completion"]
    assert refused(info.show, {"model": "x"}, model, limits).status == 404


def test_tool_calls_are_parsed_by_the_shared_machinery() -> None:
    from tokenwire.protocols.ollama.reply import tool_calls

    request = core.Request("chat", M, False, None, tool_mode="auto", tool_names={"weather"})
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert tool_calls(request, text) == [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert tool_calls(request, "It is sunny.") == []


def test_chat_tools_through_a_template_that_reads_them(
    limits: ModelLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenwire.protocols.openai import chat

    monkeypatch.setattr(chat, "supports_tools", lambda tokenizer: True)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    body = {
        "model": M,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "stream": True,
    }
    request = core.plan_chat(body, limits)
    assert request.tool_mode == "auto" and request.tool_names == {"weather"}
    reply = Reply(request)
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert reply.feed(TokenEvent(17, 40, False, text=call)) is None  # held for the last line
    reply.feed(FinishEvent("eos", 40, 1))
    message = reply.final()["message"]
    assert message["tool_calls"] == [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert message["content"] == ""
