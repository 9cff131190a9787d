"""Every way a request ends: the FinishEvent's reason and usage, and the last token's reason."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_parity import GREEDY, make_engine, rand_tokens
from tokenwire.engine.constraints import Constraint, ConstraintStep
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent, iter_events


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine, _ = make_engine("smollm2", tokenizer, max_model_len=64)
    yield engine
    engine.shutdown()


def run(engine, prompt: list[int], **kw) -> tuple[list[TokenEvent], FinishEvent]:
    kw.setdefault("sampling", GREEDY)
    events, finish = engine.generate(None, prompt, GenerateOptions(**kw)).result()
    return events, finish


def generated(events: list[TokenEvent]) -> list[TokenEvent]:
    return [e for e in events if not e.is_prefill]


def assert_marked(events: list[TokenEvent], finish: FinishEvent) -> None:
    """The token that ended generation carries the same reason; no other token carries one."""
    tokens = generated(events)
    assert tokens[-1].finish_reason == finish.reason
    assert all(e.finish_reason is None for e in tokens[:-1])
    assert finish.completion_tokens == len(tokens)


def test_eos(engine) -> None:
    eos = min(engine.eos_ids)
    prompt = rand_tokens(6, 1)
    events, finish = run(engine, prompt, max_tokens=10, sampling=SamplingParams(0.0, logit_bias={eos: 1e4}))
    assert (finish.reason, finish.stop_detail, finish.prompt_tokens) == ("eos", eos, 6)
    assert [e.token_id for e in events] == [eos] and finish.total_tokens == 7
    assert_marked(events, finish)


def test_length_by_max_tokens_and_by_the_context(engine) -> None:
    events, finish = run(engine, rand_tokens(6, 2), max_tokens=5, ignore_eos=True)
    assert (finish.reason, finish.completion_tokens) == ("length", 5)
    assert_marked(events, finish)
    events, finish = run(engine, rand_tokens(60, 3), max_tokens=50, ignore_eos=True)
    assert (finish.reason, finish.completion_tokens) == ("length", 4)  # max_model_len 64
    assert_marked(events, finish)


def test_prefill_only_ends_with_length_and_no_generated_token(engine) -> None:
    events, finish = run(engine, rand_tokens(6, 4), max_tokens=0, logprob_ranges=[(1, 6)])
    assert (finish.reason, finish.completion_tokens) == ("length", 0)
    assert len(events) == 5 and all(e.is_prefill and e.finish_reason is None for e in events)


def test_stop_token_and_stop_string(engine, tokenizer) -> None:
    prompt = rand_tokens(12, 7)
    events, _ = run(engine, prompt, max_tokens=30, ignore_eos=True)
    first = events[0].token_id
    stopped, finish = run(engine, prompt, max_tokens=30, ignore_eos=True, stop_token_ids=[first])
    assert (finish.reason, finish.stop_detail) == ("stop", first) and len(stopped) == 1
    assert_marked(stopped, finish)
    text = "".join(e.text for e in events)
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    stopped, finish = run(engine, prompt, max_tokens=30, ignore_eos=True, stop=[needle])
    assert (finish.reason, finish.stop_detail) == ("stop", needle)
    assert needle in "".join(e.text for e in stopped) and len(stopped) < 30
    assert_marked(stopped, finish)


class StopAfter(Constraint):
    """Allows `count` tokens, then stops the sequence."""

    def __init__(self, count: int, fail: bool = False) -> None:
        self.count, self.fail, self.seen = count, fail, 0

    def next_step(self) -> ConstraintStep:
        if self.seen >= self.count:
            if self.fail:
                raise RuntimeError("constraint broke")
            return ConstraintStep(stop=True)
        return ConstraintStep()

    def on_token(self, token: int) -> None:
        self.seen += 1


def test_constraint_stop_and_constraint_error(engine) -> None:
    events, finish = run(engine, rand_tokens(6, 6), max_tokens=9, ignore_eos=True, constraint=StopAfter(2))
    assert (finish.reason, finish.stop_detail, finish.completion_tokens) == ("stop", "constraint", 2)
    assert all(e.finish_reason is None for e in events)  # decided before a token: no token to mark
    c = StopAfter(2, fail=True)
    events, finish = run(engine, rand_tokens(6, 6), max_tokens=9, ignore_eos=True, constraint=c)
    assert finish.reason == "error" and "RuntimeError: constraint broke" in finish.error
    assert finish.completion_tokens == 2 and len(events) == 2


def test_cancelled(engine) -> None:
    handle = engine.generate(None, rand_tokens(6, 7), GenerateOptions(max_tokens=40, ignore_eos=True))
    events = iter_events(handle)
    first = next(events)
    handle.cancel()
    rest = list(events)
    finish = rest[-1]
    assert isinstance(finish, FinishEvent) and finish.reason == "cancelled" and finish.error is None
    assert finish.prompt_tokens == 6 and finish.completion_tokens == 1 + len(rest) - 1
    assert first.finish_reason is None


def test_error_when_the_kv_budget_runs_out(tokenizer) -> None:
    engine, _ = make_engine("smollm2", tokenizer, kv_cache_mb=0.05)
    try:
        blocks = engine.kv.num_blocks
        _, finish = engine.generate(
            None, rand_tokens(4, 8), GenerateOptions(max_tokens=16 * blocks, ignore_eos=True)
        ).result()
        assert finish.reason == "error" and "KV cache budget exhausted" in finish.error
        assert 0 < finish.completion_tokens < 16 * blocks
    finally:
        engine.shutdown()
