"""Draft-model speculation (engine/draft.py): a tiny draft of the same vocabulary guesses for a
tiny target, and the target's greedy tokens and logprobs are the bits it gives without guesses;
a draft of another vocabulary is refused at start, naming the difference."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.test_engine_parity import rand_tokens
from tests.engine.test_speculation import _run, _tiny
from tests.tiny_models import hf_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import EngineHandle, GenerateOptions, SamplingParams
from tokenwire.model.families import build_model, read_config
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import Q4_1

DATA = Path(__file__).parents[1] / "data"


def _other_draft():
    """A random model of other widths and weights with SmolLM2's vocabulary: guesses mostly wrong."""
    hf = hf_model("llama2")
    tensors, qtypes = quantize_state(dict(hf.state_dict()), Q4_1)
    return build_model(read_config(hf.config.to_dict()), tensors, qtypes)


@pytest.mark.parametrize("draft_of", [_tiny, _other_draft], ids=["same-weights", "other-weights"])
def test_greedy_tokens_and_logprobs_are_the_bits_without_guesses(tokenizer, draft_of) -> None:
    target = _tiny()
    draft = Engine(draft_of(), tokenizer, name="draft", kv_cache_mb=16, speculate="off")
    on = Engine(target, tokenizer, name="on", kv_cache_mb=16, speculate="draft", draft=draft)
    off = Engine(target, tokenizer, name="off", kv_cache_mb=16, speculate="off")
    try:
        for seed in (30, 31):
            prompt = rand_tokens(40, seed)
            sid_on, sid_off = on.create_session(), off.create_session()
            for turn in range(2):  # a second turn: the draft session follows the request's tokens
                tail = prompt if turn == 0 else rand_tokens(5, seed + 10)
                assert _run(on, sid_on, tail, max_tokens=24) == _run(off, sid_off, tail, max_tokens=24)
            assert on.session_tokens(sid_on) == off.session_tokens(sid_off)
        stats = on.stats()
        assert stats["spec_proposed"] > 0
        if draft_of is _tiny:  # the target's own weights: every guess is what it picks
            assert stats["spec_accepted"] == stats["spec_proposed"]
        assert draft.stats()["sessions"] == 0  # each request's draft session closed with it
    finally:
        on.shutdown()  # and its draft
        off.shutdown()
    assert draft.shutdown()


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path: Path) -> None:
    settings = EngineSettings(
        draft_model=str(DATA / "tiny-llama-Q4_K_M.gguf"), progress=False, kv_cache_mb=8, cache_dir=tmp_path
    )
    with pytest.raises(ValueError, match="vocabulary of 259 tokens, the model 49152"):
        build_engine(settings)


def test_draft_speculation_needs_its_model_and_guesses() -> None:
    with pytest.raises(ValueError, match="--speculate draft needs --draft-model"):
        build_engine(EngineSettings(speculate="draft", progress=False))
    with pytest.raises(ValueError, match="cannot go with --speculate off"):
        build_engine(EngineSettings(draft_model="x.gguf", speculate="off", progress=False))


def _spy_draft_steps(draft: Engine, on_step) -> list[int]:
    """The number of requests in each of the draft engine's steps; `on_step` runs in each (on
    the draft's model thread, its lock held)."""
    sizes: list[int] = []
    schedule = draft.scheduler.schedule

    def spy(fail):
        items = schedule(fail)
        if items:
            sizes.append(len(items))
            on_step()
        return items

    draft.scheduler.schedule = spy
    return sizes


def test_draft_guesses_run_as_one_batch_outside_the_target_lock(tokenizer) -> None:
    """Every request's draft call of a step is in before any is awaited (one draft step serves
    them all), and the target's lock is free while the draft runs (API calls go on)."""
    draft = Engine(_tiny(), tokenizer, name="draft", kv_cache_mb=16, speculate="off")
    on = Engine(_tiny(), tokenizer, name="on", kv_cache_mb=16, speculate="draft", draft=draft)
    free: list[bool] = []

    def lock_is_free() -> None:  # a timeout, not a measure: only a held lock makes it fail
        got = on.holding().acquire(timeout=1.0)
        free.append(got)
        if got:
            on.holding().release()

    sizes = _spy_draft_steps(draft, lock_is_free)
    opts = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    try:
        with on.holding():  # all four in the target's first step, so in one round of guesses
            handles = [on.generate(None, rand_tokens(30, seed), opts) for seed in range(4)]
        for handle in handles:
            assert handle.result()[1].reason == "length"
        assert on.stats()["spec_proposed"] > 0
        assert max(sizes) == 4  # before: one request per draft step
        assert free and all(free)  # before: the target's model thread held it in schedule()
    finally:
        on.shutdown()
    assert draft.shutdown()


def test_a_request_cancelled_while_its_draft_runs_closes_its_draft_session(tokenizer) -> None:
    draft = Engine(_tiny(), tokenizer, name="draft", kv_cache_mb=16, speculate="off")
    on = Engine(_tiny(), tokenizer, name="on", kv_cache_mb=16, speculate="draft", draft=draft)
    opts = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    cancelled: list[EngineHandle] = []

    def cancel_first() -> None:  # mid-draft: the target's lock is free, cancel() goes through
        if not cancelled:
            cancelled.append(handle)
            # from another thread, joined with a bound: a target holding its lock while it waits
            # for this draft step (as before) must cost the test time, not hang it
            canceller = threading.Thread(target=handle.cancel)
            canceller.start()
            canceller.join(timeout=5.0)

    _spy_draft_steps(draft, cancel_first)
    try:
        with on.holding():  # `handle` is bound before the target's loop can plan its guesses
            handle = on.generate(None, rand_tokens(30, 1), opts)
        assert handle.result()[1].reason == "cancelled"
        # a request after it: the target's loop has settled the cancelled one's draft call
        del draft.scheduler.schedule  # the spy's instance attribute: the class's method again
        assert on.generate(None, rand_tokens(30, 2), opts).result()[1].reason == "length"
        assert draft.stats()["sessions"] == 0
    finally:
        on.shutdown()
    assert draft.shutdown()
