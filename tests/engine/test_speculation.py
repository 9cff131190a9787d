"""Prompt-lookup speculation (engine/speculation.py): the same bits as one token a step, with
guesses proposed and kept (counted, so no test here passes by never guessing); the KV, length
and grammar state after a rejected guess; the distribution kept when sampling."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from tests.engine.test_engine_parity import GREEDY, rand_tokens
from tests.tiny_models import hf_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent, iter_events
from tokenwire.engine.speculation import Speculator, StepCost, StepShape
from tokenwire.model.families import build_model, read_config
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import Q4_1

Run = list[tuple[int, float]]


def test_guesses_follow_the_latest_earlier_ngram() -> None:
    spec = Speculator()
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert spec.propose(tokens, 10) == [8, 9, 1, 2, 5, 6, 7]  # after 5 6 7: what followed it
    assert spec.propose(tokens, 2) == [8, 9]  # the step's room caps them
    assert spec.propose([*tokens, 3], 10) == []  # 7 3 never seen, nor 3: no guess
    assert spec.propose([1, 2, 3], 10) == []  # rewritten context: re-indexed, no earlier match


def test_a_guess_is_made_only_while_its_chance_pays_for_its_row() -> None:
    spec = Speculator()
    assert (spec.first, spec.next) == (0.6, 0.8)
    assert spec.guesses(0.4) == 2  # kept with chance 0.6, then 0.48, then 0.384 < 0.4
    assert spec.guesses(0.7) == 0
    for _ in range(4):
        spec.verified(2, 2)  # every guess kept: both chances rise
    assert spec.first > 0.8 and spec.next > 0.9 and spec.guesses(0.4) == 8
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    for _ in range(12):
        spec.verified(8, 0)  # a stretch of misses: not worth a row at 0.4
    assert spec.guesses(0.4) == 0
    # one guess now and then to keep the estimate current, 64 steps apart after so many misses
    probes = []
    for _ in range(70):
        probes.append(len(spec.propose(tokens, 10, 0.4)))
        if probes[-1]:
            spec.verified(probes[-1], 0)  # missed again
    assert max(probes) == 1 and sum(probes) == 1


def test_step_cost_fits_fixed_and_per_row_time() -> None:
    cost = StepCost()
    short = StepShape.decodes([10])
    f, r, p, k = StepCost.PRIOR  # the prior's shape until steps are observed
    assert cost.guess_share(short, 10) == pytest.approx((r + p * 10) / (f + r + (p + k) * 10))
    for rows in [1, 2, 3, 5, 9] * 4:  # short contexts: the attention is a few positions
        cost.observe(StepShape(rows, rows * 10, 10), 0.003 + 0.00125 * rows)
    assert cost.guess_share(short, 10) == pytest.approx(1.25 / 4.25, rel=0.02)
    assert cost.guess_share(StepShape.decodes([10] * 8), 10) == pytest.approx(10 / 13, rel=0.02)


def test_step_cost_charges_a_guess_its_attention_over_a_long_context() -> None:
    """Steps at 100 and 8,000 positions, rows varying (a decode row and its guesses): what a
    guess costs at 8k is its row and its attention over the 8k, not a short row's cost."""
    fixed, per_row, per_position, per_read = 0.002, 0.001, 1e-6, 0.4e-6

    def seconds(shape: StepShape) -> float:
        return fixed + per_row * shape.rows + per_position * shape.positions + per_read * shape.read

    cost = StepCost()
    for context in [100, 8000] * 10:
        for guesses in [0, 1, 3]:
            rows = 1 + guesses  # rows at context-1 .. context+guesses-1: each attends its prefix
            shape = StepShape(rows, rows * context + rows * (rows - 1) // 2, context + guesses)
            cost.observe(shape, seconds(shape))
    at_8k = StepShape.decodes([8000])
    want_8k = (per_row + per_position * 8000) / seconds(at_8k)  # 9 ms of a 13.2 ms step: 0.68
    assert cost.guess_share(at_8k, 8000) == pytest.approx(want_8k, rel=0.05)
    at_100 = StepShape.decodes([100])
    want_100 = (per_row + per_position * 100) / seconds(at_100)  # 1.1 of 3.14 ms: 0.35
    assert cost.guess_share(at_100, 100) == pytest.approx(want_100, rel=0.05)
    # a short row's cost at 8k (attention not counted) would be 1.1 / 13.2 ms: 0.08
    assert cost.guess_share(at_8k, 8000) > 0.6


def _tiny() -> torch.nn.Module:
    hf = hf_model("smollm2")
    tensors, qtypes = quantize_state(dict(hf.state_dict()), Q4_1)
    return build_model(read_config(hf.config.to_dict()), tensors, qtypes)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return _tiny()


def _run(engine: Engine, session: str | None, tokens: list[int], **kw) -> Run:
    opts = GenerateOptions(
        **{"max_tokens": 40, "ignore_eos": True, "sampling": GREEDY, "logprobs": True, **kw}
    )
    events, _ = engine.generate(session, tokens, opts).result()
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent) and not e.is_prefill]


def _pair(model, tokenizer, **kw) -> tuple[Engine, Engine]:
    on = Engine(model, tokenizer, name="on", kv_cache_mb=16, speculate="ngram", **kw)
    off = Engine(model, tokenizer, name="off", kv_cache_mb=16, speculate="off", **kw)
    return on, off


def test_greedy_tokens_and_logprobs_are_the_bits_of_one_token_a_step(tiny, tokenizer) -> None:
    """A random tiny model repeats itself soon, so guesses are made and kept; through a session,
    a fork mid-session, a prefix-cache hit and stop strings."""
    on, off = _pair(tiny, tokenizer)
    try:
        prompt = rand_tokens(30, 3) * 3  # the context repeats: its n-grams have followers
        assert _run(on, None, prompt) == _run(off, None, prompt)
        sid_on, sid_off = on.create_session(), off.create_session()
        assert _run(on, sid_on, prompt[:50]) == _run(off, sid_off, prompt[:50])
        fork_on, fork_off = on.fork_session(sid_on, 61), off.fork_session(sid_off, 61)
        assert _run(on, fork_on, prompt[50:70]) == _run(off, fork_off, prompt[50:70])
        hits = on.stats()["prefix_cache_hits"]
        hit = [*prompt[:64], 7, 8]
        assert _run(on, None, hit) == _run(off, None, hit)
        assert on.stats()["prefix_cache_hits"] > hits
        text = tokenizer.decode(_run(off, None, prompt, max_tokens=30)[-1:][0][:1])
        stop = {"stop": [text], "max_tokens": 60}
        assert _run(on, None, prompt, **stop) == _run(off, None, prompt, **stop)
        stats = on.stats()
        assert stats["spec_accepted"] > 20 and stats["spec_proposed"] >= stats["spec_accepted"]
        assert off.stats()["spec_proposed"] == 0
    finally:
        on.shutdown()
        off.shutdown()


def test_a_regex_constraint_holds_and_rolls_back_with_the_guesses(tiny, tokenizer) -> None:
    on, off = _pair(tiny, tokenizer)
    try:
        pattern = r"(ab|cd)+"
        ids = tokenizer.encode("ab cd ab cd ab cd")
        runs = []
        for engine in (on, off):
            constraint = GrammarConstraint.regex(tokenizer.hf, engine.logits_size, pattern)
            runs.append(_run(engine, None, ids * 4, constraint=constraint, max_tokens=24))
        assert runs[0] == runs[1]
        assert on.stats()["spec_proposed"] > 0
    finally:
        on.shutdown()
        off.shutdown()


class _HalfRightGuesses(Speculator):
    """Guesses from a known continuation with every third one wrong: kept, kept, rejected."""

    def __init__(self, continuation: list[int]) -> None:
        super().__init__()
        self.continuation = continuation

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        guesses = self.continuation[len(tokens) : len(tokens) + min(limit, 3)]
        if len(guesses) == 3:
            guesses[2] = guesses[2] + 1
        return guesses


def test_after_a_rejected_guess_the_session_equals_one_without_guesses(tiny, tokenizer, monkeypatch) -> None:
    """Length, computed positions and the KV of every computed position, bit for bit, after
    steps whose guesses were partly kept and partly rejected."""
    on, off = _pair(tiny, tokenizer, kv_dtype="fp32")
    try:
        prompt = rand_tokens(40, 20)
        sids = [on.create_session(), off.create_session()]
        _run(off, sids[1], prompt, max_tokens=33)
        expected = off.session_tokens(sids[1])
        monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda: _HalfRightGuesses(expected))
        _run(on, sids[0], prompt, max_tokens=33)
        stats = on.stats()
        assert stats["spec_proposed"] > stats["spec_accepted"] > 0  # some kept, some rejected
        sessions = [e._sessions[s] for e, s in zip((on, off), sids, strict=True)]
        assert sessions[0].tokens == sessions[1].tokens
        assert sessions[0].num_computed == sessions[1].num_computed == len(sessions[0].tokens) - 1
        n, bs = sessions[0].num_computed, on.kv.block_size
        for cache in ("k", "v"):
            rows = []
            for engine, session in zip((on, off), sessions, strict=True):
                flat = getattr(engine.kv, cache).flatten(1, 2)  # [layers, slots, kv_heads, D]
                slots = [session.block_table[p // bs] * bs + p % bs for p in range(n)]
                rows.append(flat[:, slots])
            assert torch.equal(rows[0], rows[1])
    finally:
        on.shutdown()
        off.shutdown()


def test_the_access_log_line_counts_a_request_s_guesses(tiny, tokenizer, monkeypatch, caplog) -> None:
    """Each request's access line says how many guesses it ran and kept (metrics.observe_request)."""
    from tokenwire.metrics import observe_request

    on, off = _pair(tiny, tokenizer)
    try:
        prompt = rand_tokens(40, 21)
        sid = off.create_session()
        _run(off, sid, prompt, max_tokens=33)
        expected = off.session_tokens(sid)
        monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda: _HalfRightGuesses(expected))
        on.on_finish = observe_request
        caplog.set_level(logging.INFO, logger="tokenwire.access")
        _run(on, None, prompt, max_tokens=33)
        lines = [r.getMessage() for r in caplog.records if r.name == "tokenwire.access"]
        stats = on.stats()
        assert stats["spec_proposed"] > stats["spec_accepted"] > 0
        assert f"guesses={stats['spec_proposed']}" in lines[-1]
        assert f"guesses_kept={stats['spec_accepted']}" in lines[-1]
    finally:
        on.shutdown()
        off.shutdown()


def test_a_request_cancelled_mid_verification_frees_every_block(tiny, tokenizer) -> None:
    engine = Engine(tiny, tokenizer, name="on", kv_cache_mb=16, speculate="ngram")
    try:
        opts = GenerateOptions(max_tokens=400, ignore_eos=True, sampling=GREEDY, use_prefix_cache=False)
        handle = engine.generate(None, rand_tokens(20, 4) * 4, opts)
        for seen, _ in enumerate(iter_events(handle)):
            if seen == 30:
                handle.cancel()
        done = threading.Event()
        engine.call_on_model_thread(done.set).result()
        assert engine.stats()["spec_proposed"] > 0
        assert engine.kv.allocator.num_available == engine.kv.num_blocks
    finally:
        engine.shutdown()


def test_seeded_sampling_gives_the_tokens_of_a_run_without_guesses(tiny, tokenizer, monkeypatch) -> None:
    """The token at a guessed row is drawn as a one-token step draws it (sampler.sample), so a
    seeded request's tokens and logprobs do not depend on what was guessed or kept."""
    on, off = _pair(tiny, tokenizer)
    try:
        prompt = rand_tokens(20, 9)
        for seed in range(4):
            sampling = SamplingParams(temperature=0.8, seed=seed)
            sid = off.create_session()
            alone = _run(off, sid, prompt, sampling=sampling)
            guesses = off.session_tokens(sid)  # what that run drew: guessed, every third one wrong
            monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda g=guesses: _HalfRightGuesses(g))
            assert _run(on, None, prompt, sampling=sampling) == alone
        stats = on.stats()
        assert stats["spec_proposed"] > stats["spec_accepted"] > 10
    finally:
        on.shutdown()
        off.shutdown()


class _FixedGuesses(Speculator):
    def __init__(self, guesses: list[int]) -> None:
        super().__init__()
        self.fixed = guesses

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        return self.fixed[:limit]


def test_sampled_tokens_at_guessed_rows_follow_the_model(tiny, tokenizer, monkeypatch) -> None:
    """Through the engine on a tiny model: the token sampled at a guessed row (the second of
    each request, drawn against a fixed guess) has the model's distribution given the first.
    top_k 4 keeps the outcomes few; chi-square with 3 degrees of freedom under 16.3 (p = 0.001)
    for every first token seen often enough, at fixed seeds."""
    engine = Engine(tiny, tokenizer, name="on", kv_cache_mb=16, speculate="ngram")
    try:
        prompt = rand_tokens(12, 31)
        sampling = SamplingParams(temperature=1.0, top_k=4)
        # the model's own distribution of the second token after each first one: from one
        # greedy-free step over prompt + first (the engine's exact logits)
        firsts = torch.topk(_logits(engine, prompt), 4).indices.tolist()
        guess = torch.topk(_logits(engine, [*prompt, firsts[0]]), 4).indices[1].item()  # a likely one
        monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda: _FixedGuesses([guess, 7]))
        pairs: dict[int, list[int]] = {}
        # three tokens: the first decode step then has room for one guess, drawn against; 32
        # requests at a time (a seeded request's tokens do not depend on its company)
        for wave in range(0, 1200, 32):
            options = [
                GenerateOptions(max_tokens=3, sampling=SamplingParams(1.0, top_k=4, seed=s))
                for s in range(wave, min(wave + 32, 1200))
            ]
            handles = [engine.generate(None, prompt, opts) for opts in options]
            for handle in handles:
                events, _ = handle.result()
                pairs.setdefault(events[0].token_id, []).append(events[1].token_id)
        assert engine.stats()["spec_proposed"] >= 1200
        tested = 0
        for first, seconds in pairs.items():
            if len(seconds) < 200:
                continue
            logits = _logits(engine, [*prompt, first]) / sampling.temperature
            top = torch.topk(logits, 4)
            p = torch.softmax(top.values, -1)
            counts = torch.tensor([seconds.count(t) for t in top.indices.tolist()], dtype=torch.float64)
            assert counts.sum() == len(seconds)  # top_k 4: nothing else is drawn
            chi2 = float((((counts - len(seconds) * p) ** 2) / (len(seconds) * p)).sum())
            assert chi2 < 16.3, (first, counts.tolist(), p.tolist(), chi2)
            tested += 1
        assert tested >= 1
    finally:
        engine.shutdown()


def _logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """The model's logits after `tokens` (prompt logprobs of a one-token continuation)."""
    opts = GenerateOptions(max_tokens=1, sampling=GREEDY, logprobs=True, top_logprobs=engine.logits_size)
    events, _ = engine.generate(None, tokens, opts).result()
    row = torch.full((engine.logits_size,), float("-inf"), dtype=torch.float64)
    for token, logprob in events[-1].top_logprobs:
        row[token] = logprob
    return row


def test_seeded_sampling_with_guesses_is_reproducible(tiny, tokenizer, monkeypatch) -> None:
    engine = Engine(tiny, tokenizer, name="on", kv_cache_mb=16, speculate="ngram")
    try:
        prompt = rand_tokens(20, 9)
        sid = engine.create_session()
        _run(engine, sid, prompt, max_tokens=40)  # greedy: the guesses' source
        guesses = engine.session_tokens(sid)
        monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda: _HalfRightGuesses(guesses))
        sampling = SamplingParams(temperature=0.5, seed=7)
        runs = [_run(engine, None, prompt, sampling=sampling, max_tokens=40) for _ in range(2)]
        assert runs[0] == runs[1] and engine.stats()["spec_proposed"] > 0
    finally:
        engine.shutdown()


def test_smollm2_copies_a_text_with_guesses_and_the_same_bits(smollm2_engine) -> None:
    """The real model asked to repeat a paragraph: most tokens come from kept guesses, and the
    tokens and logprobs are those of one token a step."""
    engine = smollm2_engine
    off = Engine(engine.model, engine.tokenizer, name="off", kv_cache_mb=64, speculate="off")
    try:
        text = (
            "The river rises in the hills above the town, runs past the old mill and the school, "
            "and reaches the sea at a wide bay where the fishing boats come in each evening."
        )
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
        )
        before = engine.stats()["spec_accepted"]
        assert _run(engine, None, prompt, max_tokens=48) == _run(off, None, prompt, max_tokens=48)
        assert engine.stats()["spec_accepted"] - before >= 20
    finally:
        off.shutdown()


def test_a_grammar_cuts_the_guesses_it_refuses_and_adds_the_span_it_forces(tokenizer) -> None:
    """GrammarConstraint.speculation: a guess the grammar forbids is never run (the guesses stop
    before it), and after the ones it allows comes the span it would force there."""
    pattern = r"The answer is [0-9]+, as the table shows\."
    constraint = GrammarConstraint.regex(tokenizer.hf, 49152, pattern)
    opening = constraint.next_step().force
    assert constraint.speculation([], 20) == (0, opening)  # forced now: run as the guesses
    for token in opening:
        constraint.on_token(token)
    assert constraint.speculation([], 20) == (0, [])  # the digits are the model's to pick
    digits = tokenizer.encode("42,")
    allowed, forced = constraint.speculation(digits, 20)
    assert allowed == len(digits)
    assert forced and " as the table shows.".startswith(tokenizer.decode(forced))
    assert constraint.speculation(digits, len(digits) + 1) == (len(digits), forced[:1])
    refused = tokenizer.encode("4") + tokenizer.encode("x") + tokenizer.encode("2")
    assert constraint.speculation(refused, 20) == (1, [])  # the guesses stop before "x"
    assert constraint.speculation(digits, 20) == (allowed, forced)  # its own state untouched


def test_a_forced_span_rides_in_the_forward_of_the_token_before_it(tiny, tokenizer, monkeypatch) -> None:
    """With no prompt-lookup guess at all, a grammar's forced spans run as guesses after the
    token before them: fewer steps, every one kept, the same tokens and logprobs."""
    monkeypatch.setattr("tokenwire.engine.engine.Speculator", lambda: _FixedGuesses([]))
    on, off = _pair(tiny, tokenizer)
    try:
        pattern = r"(item [0-9]: the value is fixed here\. ){3}"
        runs, steps = [], []
        for engine in (on, off):
            constraint = GrammarConstraint.regex(tokenizer.hf, engine.logits_size, pattern)
            before = engine.steps
            runs.append(_run(engine, None, rand_tokens(12, 5), constraint=constraint, max_tokens=60))
            steps.append(engine.steps - before)
        assert runs[0] == runs[1]
        stats = on.stats()
        assert stats["spec_proposed"] == stats["spec_accepted"] > 10
        assert steps[0] < steps[1], steps
    finally:
        on.shutdown()
        off.shutdown()


def test_readouts_with_guesses_are_the_bits_of_one_token_a_step(tiny, tokenizer) -> None:
    """Readouts (hidden states projected on concepts) of prompt and generated positions, with
    tokens and logprobs, bit for bit with and without guesses; guesses kept along the way."""
    from tokenwire.engine.concepts import ConceptSet

    hidden = tiny.config.hidden_size
    concepts = ConceptSet(
        ["a", "b"], [0, 2], torch.randn(2, 2, hidden, generator=torch.Generator().manual_seed(3))
    )
    on, off = _pair(tiny, tokenizer, concepts=concepts)
    try:
        prompt = rand_tokens(30, 3) * 3
        opts = {"max_tokens": 40, "ignore_eos": True, "sampling": GREEDY, "logprobs": True}
        results = []
        for engine in (on, off):
            ranges = [(70, 90), (95, 200)]  # a stretch of the prompt, then generated positions with a gap
            events, _ = engine.generate(None, prompt, GenerateOptions(**opts, readout_ranges=ranges)).result()
            results.append([(e.position, e.token_id, e.logprob, e.readout) for e in events])
        assert [r[:3] for r in results[0]] == [r[:3] for r in results[1]]
        positions = [r[0] for r in results[0] if r[3] is not None]
        assert positions == [*range(70, 90), *range(95, 130)]  # 90 prompt positions, 40 generated
        for mine, theirs in zip(results[0], results[1], strict=True):
            assert (mine[3] is None) == (theirs[3] is None)
            assert mine[3] is None or torch.equal(mine[3], theirs[3])
        assert on.stats()["spec_accepted"] > 10
    finally:
        on.shutdown()
        off.shutdown()
