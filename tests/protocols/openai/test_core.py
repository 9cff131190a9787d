"""The sans-IO core on plain values: chat continuation, stop-string hold-back, penalties, tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tokenwire.engine.admission import Limits
from tokenwire.engine.constraints import Constraint, ConstraintStep
from tokenwire.engine.request import FinishEvent, TokenEvent
from tokenwire.protocols.openai import chat, core
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.output import ChoiceOutput
from tokenwire.protocols.openai.sampling import PenaltyConstraint
from tokenwire.protocols.openai.schemas import ChatCompletionRequest


@pytest.fixture(scope="module")
def tok(smollm2_source: Any) -> Any:
    return smollm2_source.tokenizer


@pytest.fixture(scope="module")
def limits(tok: Any) -> core.ModelLimits:
    engine = Limits(vocab_size=tok.vocab_size, max_model_len=8192, kv_blocks=1024, kv_block_size=16)
    return core.ModelLimits(
        "m", tok, 8192, tok.vocab_size, tok.vocab_size, frozenset(tok.eos_token_ids), engine
    )


TURN1 = [{"role": "user", "content": "Hello there"}]
REPLY = "General Kenobi!"
TURN2 = [{"role": "user", "content": "You are a bold one."}]


@pytest.mark.parametrize("ended_on_eos", [True, False])
def test_a_session_continuation_is_the_full_conversation(tok: Any, ended_on_eos: bool) -> None:
    """Session tokens (turn 1 + the reply as generated, with or without EOS) + the appended
    continuation == the whole history rendered in one go."""
    session = tok.apply_chat_template(TURN1) + tok.encode(REPLY, add_special_tokens=False)
    if ended_on_eos:
        session += tok.eos_token_ids[:1]
    append = chat.prompt_tokens(tok, TURN2, session[-16:])
    full = tok.apply_chat_template([*TURN1, {"role": "assistant", "content": REPLY}, *TURN2])
    assert session + append == full


def test_an_empty_session_gets_the_whole_template(tok: Any) -> None:
    assert chat.prompt_tokens(tok, TURN1, []) == tok.apply_chat_template(TURN1)


def _out(tok: Any, stops: list[str]) -> ChoiceOutput:
    return ChoiceOutput(
        0, tok, frozenset(tok.eos_token_ids), stops=stops, ignore_eos=False, legacy_logprobs=False
    )


def _event(tok: Any, text: str, position: int) -> TokenEvent:
    (token,) = tok.encode(text, add_special_tokens=False)[:1]
    return TokenEvent(token, position, False, text=text)


def test_text_that_may_become_a_stop_string_is_held_back(tok: Any) -> None:
    out = _out(tok, ["\n\nUser"])
    assert out.feed(_event(tok, "Hi", 10)).text == "Hi"
    assert out.feed(_event(tok, "\n", 11)).text == ""  # may start the stop string
    assert out.feed(_event(tok, "\n", 12)).text == ""
    assert out.feed(_event(tok, "User", 13)).text == ""
    last = out.feed(FinishEvent("stop", 10, 4, stop_detail="\n\nUser"))
    assert last.text == "" and out.generated == "Hi" and out.finish_reason == "stop"


def test_held_back_text_is_released_when_it_does_not_stop(tok: Any) -> None:
    out = _out(tok, ["\n\nUser"])
    out.feed(_event(tok, "Hi", 10))
    assert out.feed(_event(tok, "\n", 11)).text == ""
    assert out.feed(_event(tok, "Bye", 12)).text == "\nBye"
    eos = tok.eos_token_ids[0]
    assert out.feed(TokenEvent(eos, 13, False, text="<|im_end|>")).text == ""  # EOS is not output
    assert out.feed(FinishEvent("eos", 10, 3)).text == ""
    assert out.generated == "Hi\nBye" and out.finish_reason == "stop"


class _Mask(Constraint):
    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self.seen: list[int] = []

    def next_step(self) -> ConstraintStep:
        return ConstraintStep(allowed=self.allowed)

    def on_token(self, token: int) -> None:
        self.seen.append(token)


def test_penalties_bias_generated_tokens_around_an_inner_constraint() -> None:
    mask = torch.ones(8, dtype=torch.bool)
    inner = _Mask(mask)
    c = PenaltyConstraint(8, presence=0.5, frequency=0.25, inner=inner)
    c.start([1, 1, 1])  # prompt tokens are not penalised (OpenAI: tokens generated so far)
    for t in (3, 3, 5):
        c.on_token(t)
    step = c.next_step()
    assert step.allowed is mask and inner.seen == [3, 3, 5]
    expected = torch.zeros(8)
    expected[3] = -(0.5 + 0.25 * 2)
    expected[5] = -(0.5 + 0.25)
    assert torch.equal(step.bias, expected)


def test_tool_calls_parse_from_each_form() -> None:
    names = {"get_time"}
    qwen = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    (call,) = chat.parse_tool_calls("auto", None, qwen, names)
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    (call,) = chat.parse_tool_calls(
        "auto", None, '{"name": "get_time", "parameters": {"zone": "CET"}}', names
    )
    assert json.loads(call["function"]["arguments"]) == {"zone": "CET"}
    assert chat.parse_tool_calls("auto", None, "It is noon.", names) == []
    assert chat.parse_tool_calls("auto", None, '{"name": "other", "arguments": {}}', names) == []
    (call,) = chat.parse_tool_calls(
        "required", None, '{"name": "get_time", "arguments": {"zone": "UTC"}}', names
    )
    assert call["id"].startswith("call_") and call["type"] == "function"


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_plans_check_before_touching_the_engine(limits: core.ModelLimits) -> None:
    """Seeds per choice, max_tokens capped by the context, the engine's admission check."""
    plan = core.plan_chat(_chat(n=3, seed=7, max_tokens=5), limits, None)
    assert [o.sampling.seed for _, o in plan.choices] == [7, 8, 9]
    assert all(o.max_tokens == 5 for _, o in plan.choices)
    unbounded = core.plan_chat(_chat(), limits, None)
    assert unbounded.choices[0][1].max_tokens == 8192 - len(unbounded.prompts[0])
    with pytest.raises(OpenAIError) as info:
        core.check_model("x", limits)
    assert info.value.status == 404
    with pytest.raises(OpenAIError) as info:
        core.plan_chat(_chat(logit_bias={str(limits.vocab_size): 1.0}), limits, None)
    assert info.value.param == "logit_bias" and info.value.code == "invalid_token"
    with pytest.raises(OpenAIError) as info:
        core.plan_chat(_chat(), limits, [1] * 8192)
    assert info.value.code == "context_length_exceeded"
    greedy = core.plan_chat(_chat(top_k=1, temperature=0.9), limits, None)
    assert greedy.choices[0][1].sampling.temperature == 0.0
    penalised = core.plan_chat(_chat(presence_penalty=1.0), limits, None)
    assert isinstance(penalised.choices[0][1].constraint, PenaltyConstraint)


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_auto_tools_reach_a_template_that_reads_them(tok: Any, limits: core.ModelLimits) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with pytest.raises(OpenAIError) as info:  # SmolLM2's own template has no tools
        core.plan_chat(_chat(tools=tools), limits, None)
    assert info.value.param == "tool_choice"
    original = tok.hf.chat_template
    tok.hf.chat_template = TOOLS_TEMPLATE
    try:
        plan = core.plan_chat(_chat(tools=tools), limits, None)
        assert plan.tool_mode == "auto" and plan.choices[0][1].constraint is None
        assert "Tools: get_time" in tok.decode(plan.prompts[0])
        none = core.plan_chat(_chat(tools=tools, tool_choice="none"), limits, None)
        assert "Tools:" not in tok.decode(none.prompts[0])
    finally:
        tok.hf.chat_template = original


def test_request_sizes_are_counted_before_the_work(limits: core.ModelLimits, monkeypatch: Any) -> None:
    """Issue 29: the work a request asks for is bounded before any of it is done: a logit_bias
    longer than the vocabulary, more choices (prompts x n) than MAX_CHOICES, a stop string past
    MAX_STOP_CHARS are each a 400 naming the field, with no prompt tokenized."""
    from pydantic import ValidationError

    from tokenwire.protocols.openai.schemas import MAX_STOP_CHARS, CompletionRequest

    monkeypatch.setattr(core, "_prompts", lambda *a, **k: pytest.fail("prompts tokenized"))
    bias = {str(i): 1.0 for i in range(limits.vocab_size + 1)}
    with pytest.raises(OpenAIError) as info:
        core.plan_chat(_chat(logit_bias=bias), limits, None)
    assert info.value.status == 400 and info.value.param == "logit_bias", info.value
    assert f"{limits.vocab_size + 1} entries" in info.value.message
    batch = CompletionRequest(model="m", prompt=["a"] * 100, n=3)
    with pytest.raises(OpenAIError) as info:
        core.plan_completion(batch, limits, None)
    assert info.value.param == "prompt" and info.value.code == "too_many_choices", info.value
    assert "300 choices" in info.value.message and str(core.MAX_CHOICES) in info.value.message
    with pytest.raises(ValidationError, match=f"at most {MAX_STOP_CHARS} characters"):
        CompletionRequest(model="m", prompt="x", stop=["y" * (MAX_STOP_CHARS + 1)])
