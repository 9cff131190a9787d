"""Sampling options, stops, constraints, priorities, cancellation and every bad-input case."""

from __future__ import annotations

import re
import time

import pytest
import torch

from tests.engine.test_engine_parity import GREEDY, make_engine, rand_tokens
from tokenwire.engine.errors import (
    ContextOverflowError,
    InvalidRequestError,
    InvalidTokenError,
    KVBudgetError,
    PositionError,
    SessionBusyError,
    SessionNotFoundError,
)
from tokenwire.engine.request import BacktrackEvent, GenerateOptions, SamplingParams, iter_events


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine, _ = make_engine("smollm2", tokenizer, max_batch_tokens=128, max_model_len=256)
    yield engine
    engine.shutdown()


def tokens_of(engine, prompt, **kw) -> tuple[list[int], str]:
    events, finish = engine.generate(None, prompt, GenerateOptions(**kw)).result()
    return [e.token_id for e in events], finish.reason


def test_seeded_sampling_is_reproducible(engine) -> None:
    prompt = rand_tokens(12, 1)
    a = tokens_of(
        engine, prompt, max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=7)
    )
    b = tokens_of(
        engine, prompt, max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=7)
    )
    c = tokens_of(
        engine, prompt, max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=8)
    )
    assert a == b
    assert a != c


def test_top_k_one_and_tiny_top_p_are_greedy(engine) -> None:
    prompt = rand_tokens(12, 2)
    greedy = tokens_of(engine, prompt, max_tokens=10, ignore_eos=True, sampling=GREEDY)
    k1 = tokens_of(
        engine,
        prompt,
        max_tokens=10,
        ignore_eos=True,
        sampling=SamplingParams(temperature=1.5, top_k=1, seed=3),
    )
    p0 = tokens_of(
        engine,
        prompt,
        max_tokens=10,
        ignore_eos=True,
        sampling=SamplingParams(temperature=1.5, top_p=1e-6, seed=3),
    )
    assert greedy == k1 == p0


def test_top_k_limits_choices(engine) -> None:
    prompt = rand_tokens(12, 3)
    opts = GenerateOptions(max_tokens=1, logprobs=True, top_logprobs=5, sampling=GREEDY)
    (first,), _ = engine.generate(None, prompt, opts).result()
    allowed = {t for t, _ in first.top_logprobs[:3]}
    for seed in range(12):
        (tok,), _ = tokens_of(
            engine, prompt, max_tokens=1, sampling=SamplingParams(temperature=5.0, top_k=3, seed=seed)
        )
        assert tok in allowed


def test_logit_bias_forces_and_bans(engine) -> None:
    prompt = rand_tokens(12, 4)
    toks, _ = tokens_of(
        engine,
        prompt,
        max_tokens=5,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, logit_bias={1234: 100.0}),
    )
    assert toks == [1234] * 5
    greedy, _ = tokens_of(engine, prompt, max_tokens=1, sampling=GREEDY)
    banned, _ = tokens_of(
        engine, prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0, logit_bias={greedy[0]: -1e9})
    )
    assert banned != greedy


def test_processed_logprobs_follow_the_bias(engine) -> None:
    prompt = rand_tokens(12, 5)
    sampling = SamplingParams(temperature=0.0, logit_bias={999: 100.0})
    raw = engine.generate(
        None, prompt, GenerateOptions(max_tokens=1, sampling=sampling, logprobs=True)
    ).result()[0][0]
    proc = engine.generate(
        None,
        prompt,
        GenerateOptions(
            max_tokens=1, sampling=sampling, logprobs=True, logprob_mode="processed", top_logprobs=2
        ),
    ).result()[0][0]
    assert raw.token_id == proc.token_id == 999
    assert raw.logprob < -1.0  # the unbiased model did not favour it
    assert proc.logprob > -1e-3 and proc.top_logprobs[0][0] == 999


def test_stop_token_ids_and_eos(engine) -> None:
    prompt = rand_tokens(12, 6)
    greedy, _ = tokens_of(engine, prompt, max_tokens=8, ignore_eos=True, sampling=GREEDY)
    events, finish = engine.generate(
        None, prompt, GenerateOptions(max_tokens=8, sampling=GREEDY, stop_token_ids=[greedy[2]])
    ).result()
    assert [e.token_id for e in events] == greedy[: greedy.index(greedy[2]) + 1]
    assert finish.reason == "stop" and finish.stop_detail == greedy[2]
    eos = next(iter(engine.eos_ids))
    toks, reason = tokens_of(
        engine, prompt, max_tokens=8, sampling=SamplingParams(temperature=0.0, logit_bias={eos: 100.0})
    )
    assert toks == [eos] and reason == "eos"


def test_stop_strings(engine, tokenizer) -> None:
    prompt = rand_tokens(12, 7)
    events, _ = engine.generate(
        None, prompt, GenerateOptions(max_tokens=30, sampling=GREEDY, ignore_eos=True)
    ).result()
    text = "".join(e.text for e in events)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    events, finish = engine.generate(
        None, prompt, GenerateOptions(max_tokens=30, sampling=GREEDY, ignore_eos=True, stop=[stop])
    ).result()
    got = "".join(e.text for e in events)
    assert finish.reason == "stop" and finish.stop_detail == stop
    assert stop in got and got.index(stop) + len(stop) > len(got) - len(events[-1].text) - len(stop)


def test_regex_constraint_output_matches(engine, tokenizer) -> None:
    from tokenwire.engine.grammar import GrammarConstraint

    pattern = r"(yes|no), [0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        constraint = GrammarConstraint.regex(tokenizer.hf, engine.logits_size, pattern)
        events, finish = engine.generate(
            None,
            rand_tokens(8, 30 + seed),
            GenerateOptions(
                max_tokens=40, constraint=constraint, sampling=SamplingParams(temperature=1.0, seed=seed)
            ),
        ).result()
        ids = [e.token_id for e in events if e.token_id not in engine.eos_ids]
        assert re.fullmatch(pattern, tokenizer.decode(ids)), (tokenizer.decode(ids), finish)
        assert finish.reason in ("eos", "stop")


def test_json_schema_constraint(engine, tokenizer) -> None:
    import json

    from tokenwire.engine.grammar import GrammarConstraint

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
        # a random-weight model loves whitespace; compact JSON keeps the test short
        "x-guidance": {"whitespace_flexible": False},
    }
    constraint = GrammarConstraint.json_schema(tokenizer.hf, engine.logits_size, schema)
    events, _ = engine.generate(
        None,
        rand_tokens(8, 40),
        GenerateOptions(
            max_tokens=60, constraint=constraint, sampling=SamplingParams(temperature=0.7, seed=1)
        ),
    ).result()
    ids = [e.token_id for e in events if e.token_id not in engine.eos_ids]
    value = json.loads(tokenizer.decode(ids))
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert any(e.forced for e in events), "the schema's fixed keys should be fast-forwarded"


class ScriptedConstraint:
    """Drives the hook's backtrack and stop paths deterministically."""

    def __init__(self) -> None:
        self.calls = 0
        self.seen: list[int] = []

    def start(self, tokens):
        pass

    def next_step(self):
        from tokenwire.engine.constraints import ConstraintStep

        self.calls += 1
        if self.calls == 3:
            return ConstraintStep(backtrack=1)
        if len(self.seen) >= 4:
            return ConstraintStep(stop=True)
        return ConstraintStep(force=[500]) if self.calls == 1 else ConstraintStep()

    def on_token(self, token):
        self.seen.append(token)

    def on_backtrack(self, n):
        del self.seen[-n:]


def test_constraint_hook_force_backtrack_stop(engine) -> None:
    c = ScriptedConstraint()
    prompt = rand_tokens(8, 41)
    events, finish = engine.generate(
        None, prompt, GenerateOptions(max_tokens=20, constraint=c, sampling=GREEDY, ignore_eos=True)
    ).result()
    assert events[0].token_id == 500 and events[0].forced
    assert any(isinstance(e, BacktrackEvent) for e in events)
    assert finish.reason == "stop" and len(c.seen) == 4


class OnlyStep(ScriptedConstraint):
    """Answers every sampling point with the same step."""

    def __init__(self, step) -> None:
        super().__init__()
        self.step = step

    def next_step(self):
        return self.step


@pytest.mark.parametrize("form", ["mask", "bias"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=3)])
def test_a_constraint_that_allows_nothing_fails_the_request(engine, form, sampling) -> None:
    from tokenwire.engine.constraints import ConstraintStep

    vocab = engine.vocab_size
    if form == "mask":
        step = ConstraintStep(allowed=torch.zeros(vocab, dtype=torch.bool))
    else:  # AICI's form of a mask: an additive -inf row
        step = ConstraintStep(bias=torch.full((vocab,), float("-inf")))
    events, finish = engine.generate(
        None, rand_tokens(6, 5), GenerateOptions(max_tokens=4, constraint=OnlyStep(step), sampling=sampling)
    ).result()
    assert events == [] and finish.reason == "error"
    assert finish.error == "constraint allows no token at this position"


def test_an_additive_minus_inf_mask_selects_like_a_boolean_mask(engine) -> None:
    from tokenwire.engine.constraints import ConstraintStep

    allowed = torch.zeros(engine.vocab_size, dtype=torch.bool)
    allowed[[17, 300, 4000]] = True
    as_bias = torch.where(allowed, 0.0, float("-inf"))
    prompt = rand_tokens(6, 9)
    results = []
    for step in (ConstraintStep(allowed=allowed), ConstraintStep(bias=as_bias)):
        events, _ = engine.generate(
            None,
            prompt,
            GenerateOptions(max_tokens=3, constraint=OnlyStep(step), sampling=GREEDY, ignore_eos=True),
        ).result()
        results.append([e.token_id for e in events])
    assert results[0] == results[1] and set(results[0]) <= {17, 300, 4000} and len(results[0]) == 3


def test_priority_orders_admission(tokenizer) -> None:
    engine, _ = make_engine("smollm2", tokenizer, max_running=1)
    try:
        order: list[str] = []
        blocker = engine.generate(None, rand_tokens(10, 50), GenerateOptions(max_tokens=30, ignore_eos=True))
        batch = engine.generate(None, rand_tokens(10, 51), GenerateOptions(max_tokens=2, priority=10))
        urgent = engine.generate(None, rand_tokens(10, 52), GenerateOptions(max_tokens=2, priority=0))
        import threading

        def wait(name, h):
            h.result()
            order.append(name)

        threads = [threading.Thread(target=wait, args=a) for a in (("batch", batch), ("urgent", urgent))]
        for t in threads:
            t.start()
        blocker.result()
        for t in threads:
            t.join()
        assert order == ["urgent", "batch"]
    finally:
        engine.shutdown()


def test_cancel_frees_blocks_by_the_end_of_the_step(engine) -> None:
    available = engine.kv.allocator.num_available
    handle = engine.generate(None, rand_tokens(100, 60), GenerateOptions(max_tokens=200, ignore_eos=True))
    stream = iter_events(handle)
    next(stream)
    handle.cancel()
    events = list(stream)
    assert events[-1].reason == "cancelled"
    # blocks the step under way still reads are freed as that step ends (never under its feet):
    # a model call runs on the model thread after it, so by its answer they must be back
    engine.call_on_model_thread(lambda: None).result(timeout=30)
    assert engine.kv.allocator.num_available == available
    assert engine.stats()["sessions"] == 0


def test_bad_input_is_rejected_clearly_and_engine_keeps_serving(engine) -> None:
    with pytest.raises(InvalidTokenError, match="49152"):
        engine.generate(None, [5, 49152])
    with pytest.raises(InvalidTokenError, match="-1"):
        engine.generate(None, [-1])
    with pytest.raises(InvalidTokenError, match="logit_bias"):
        engine.generate(None, [5], GenerateOptions(sampling=SamplingParams(logit_bias={10**6: 1.0})))
    with pytest.raises(ContextOverflowError, match="256"):
        engine.generate(None, rand_tokens(300, 1))
    with pytest.raises(InvalidRequestError, match="top_p"):
        engine.generate(None, [5], GenerateOptions(sampling=SamplingParams(top_p=0.0)))
    with pytest.raises(SessionNotFoundError, match="nope"):
        engine.generate("nope", [5])
    sid = engine.create_session(rand_tokens(20, 2))
    with pytest.raises(PositionError, match="21"):
        engine.truncate_session(sid, 21)
    with pytest.raises(PositionError, match="fork at position 30"):
        engine.fork_session(sid, 30)
    handle = engine.generate(sid, [], GenerateOptions(max_tokens=50, ignore_eos=True))
    with pytest.raises(SessionBusyError):
        engine.generate(sid, [7])
    handle.cancel()
    assert engine.close_session(sid) is True
    assert engine.close_session(sid) is False  # idempotent
    with pytest.raises(SessionNotFoundError):
        engine.generate(sid, [5])
    # still serving
    assert tokens_of(engine, [5, 6, 7], max_tokens=3, ignore_eos=True, sampling=GREEDY)[1] == "length"


def test_kv_budget_exhaustion_fails_only_the_oversized_request(tokenizer) -> None:
    engine, _ = make_engine("smollm2", tokenizer, kv_cache_mb=0.2)  # a handful of blocks
    try:
        per_block = engine.kv.block_size
        with pytest.raises(KVBudgetError, match="kv-cache-mb"):
            engine.generate(None, rand_tokens(per_block * engine.kv.num_blocks + 1, 1))
        # grows past the budget while decoding: fails with a message, others unaffected
        _, finish = engine.generate(
            None,
            rand_tokens(10, 2),
            GenerateOptions(max_tokens=per_block * engine.kv.num_blocks, ignore_eos=True),
        ).result()
        assert finish.reason == "error" and "KV cache budget exhausted" in finish.error
        assert tokens_of(engine, [5, 6], max_tokens=2, ignore_eos=True, sampling=GREEDY)[1] == "length"
    finally:
        engine.shutdown()


def test_idle_sessions_expire(tokenizer) -> None:
    engine, _ = make_engine("smollm2", tokenizer, session_ttl_s=0.2)
    try:
        sid = engine.create_session([1, 2, 3])
        keep = engine.create_session([1, 2, 3], ttl_s=None)
        deadline = time.monotonic() + 5
        while engine.has_session(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.has_session(sid)
        assert engine.has_session(keep)
    finally:
        engine.shutdown()


def test_readouts_project_hidden_states(tokenizer) -> None:
    from tests.tiny_models import hf_model
    from tokenwire.engine.concepts import ConceptSet

    hf = hf_model("llama2")
    concepts = ConceptSet(names=["a", "b"], layers=[0, 2], vectors=torch.randn(2, 2, 64))
    from tests.tiny_models import ours_from_hf
    from tokenwire.engine.engine import Engine

    engine = Engine(ours_from_hf(hf), tokenizer, name="tiny", kv_cache_mb=8, concepts=concepts)
    try:
        prompt = rand_tokens(20, 3)
        opts = GenerateOptions(max_tokens=3, sampling=GREEDY, ignore_eos=True, readout_ranges=[(5, 23)])
        events, _ = engine.generate(None, prompt, opts).result()
        positions = [e.position for e in events]
        assert positions == list(range(5, 23))
        full = prompt + [e.token_id for e in events if not e.is_prefill]
        with torch.inference_mode():
            hidden = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
        for e in events:
            expected = torch.stack(
                [
                    hidden[layer][0, e.position] @ concepts.vectors[i].T
                    for i, layer in enumerate(concepts.layers)
                ]
            )
            assert e.readout.shape == (2, 2)
            assert torch.allclose(e.readout, expected, atol=1e-3, rtol=1e-4)
    finally:
        engine.shutdown()


def test_a_scheduling_failure_fails_its_requests_and_the_engine_serves_on(tokenizer) -> None:
    """A bug in scheduling (a stub raises here) ends the requests waiting on it with an error
    naming it, instead of ending the model thread and leaving every request hanging."""
    engine, _ = make_engine("smollm2", tokenizer)
    try:
        real = engine.scheduler.schedule
        calls = []

        def broken(fail):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("stub: no room computed")
            return real(fail)

        engine.scheduler.schedule = broken  # type: ignore[method-assign]
        opts = GenerateOptions(max_tokens=4, sampling=GREEDY, ignore_eos=True)
        events, finish = engine.generate(None, rand_tokens(10, 1), opts).result()
        assert finish.reason == "error" and "scheduling failed: RuntimeError: stub" in finish.error
        events, finish = engine.generate(None, rand_tokens(10, 1), opts).result()
        assert finish.reason == "length" and len(events) == 4
    finally:
        engine.shutdown()
