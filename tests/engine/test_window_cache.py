"""Gemma 3's sliding-window layers keep their keys and values in a pool of their own, and a
sequence holds there only the blocks its window still reaches (KVCache.window_pool): a session
far longer than the window holds a window's worth of blocks for those layers, and every path
that goes back (truncate, fork, prefix-cache hits) still gives transformers'
numbers, taking let-go blocks back from the prefix cache or computing again when evicted."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine_parity import hf_prompt_logprobs, prompt_logprobs, rand_tokens
from tests.tiny_models import TINY_CONFIGS, hf_model, ours_from_hf
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams

BLOCK = 4  # small blocks, so a window of 8 spans a few and the session many
WINDOW = TINY_CONFIGS["gemma3"].sliding_window
SPANNED = -(-(WINDOW - 1) // BLOCK) + 1  # blocks 8 consecutive positions can touch


def gemma_engine(tokenizer, **kw) -> tuple[Engine, torch.nn.Module]:
    hf = hf_model("gemma3")
    model = ours_from_hf(hf)
    engine = Engine(model, tokenizer, name="tiny-gemma3", block_size=BLOCK, max_batch_tokens=32, **kw)
    return engine, hf


@pytest.fixture(scope="module")
def engine_hf(tokenizer):
    engine, hf = gemma_engine(tokenizer, kv_cache_mb=16)
    yield engine, hf
    engine.shutdown()


def test_a_long_session_holds_a_window_of_blocks_for_local_layers(engine_hf) -> None:
    engine, hf = engine_hf
    assert engine.kv.window == WINDOW and engine.kv.window_pool is not None
    assert engine.kv.window_pool.k.shape[0] == 2 and engine.kv.k.shape[0] == 2  # local / global layers
    tokens = rand_tokens(200, 11)
    sid = engine.create_session()
    events, _ = engine.generate(
        sid, tokens, GenerateOptions(max_tokens=40, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    ).result()
    length = len(engine.session_tokens(sid))
    assert length == 240
    stats = engine.stats()
    assert stats["kv_window"] == WINDOW
    # 59 full-context blocks (the last token is not computed yet), 3 for the local layers
    assert stats["kv_blocks_total"] - stats["kv_blocks_available"] >= (length - 1) // BLOCK
    assert stats["kv_window_blocks_held"] <= SPANNED
    # and the numbers are transformers': the session's own logprobs, and its greedy tokens
    got = engine.generate(sid, [], GenerateOptions(max_tokens=0, logprob_ranges=[(1, length)])).result()[0]
    expected = hf_prompt_logprobs(hf, engine.session_tokens(sid))
    assert (torch.tensor([e.logprob for e in got]) - expected).abs().max() <= 1e-4
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        out = hf.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    assert [e.token_id for e in events] == out[0, len(tokens) :].tolist()
    assert engine.stats()["kv_window_blocks_held"] <= SPANNED
    engine.close_session(sid)


def test_going_back_takes_let_go_blocks_from_the_prefix_cache(engine_hf) -> None:
    engine, hf = engine_hf
    tokens = rand_tokens(120, 12)
    sid = engine.create_session()
    engine.generate(sid, tokens, GenerateOptions(max_tokens=0)).result()
    tail = rand_tokens(30, 13)
    # a fork and a truncate 70 positions back: their windows' blocks were let go long ago
    hits = engine.stats()["kv_window_cache_hits"]
    child = engine.fork_session(sid, 50)
    engine.truncate_session(sid, 45)
    # from the cache: blocks 10-12 for the fork (positions 40-51: the window of a query at 50),
    # 9-11 for the truncate (36-47), each let go when the session passed it
    assert engine.stats()["kv_window_cache_hits"] - hits == 6
    for session, at in ((child, 50), (sid, 45)):
        computed = engine.computed_tokens
        events, _ = engine.generate(
            session, tail, GenerateOptions(max_tokens=0, logprob_ranges=[(at, at + 30)])
        ).result()
        # the tail and the row before it (its logits score the tail's first token): no more
        assert engine.computed_tokens - computed == 31
        expected = hf_prompt_logprobs(hf, tokens[:at] + tail)[at - 1 :]
        assert (torch.tensor([e.logprob for e in events]) - expected).abs().max() <= 1e-4
        assert engine.stats()["kv_window_blocks_held"] <= 2 * SPANNED
    # a new request sharing the first 100 tokens reuses both pools' blocks
    again = prompt_logprobs(engine, tokens[:100] + tail)
    assert (again - hf_prompt_logprobs(hf, tokens[:100] + tail)).abs().max() <= 1e-4
    engine.close_session(sid)
    engine.close_session(child)


def test_an_evicted_window_block_means_computing_again(tokenizer) -> None:
    """A budget of a few window spans: the blocks let go are evicted by other sessions, so going
    back computes the sequence again, and the numbers do not change."""
    engine, hf = gemma_engine(tokenizer, kv_cache_mb=16, max_running=1)
    try:
        pool = engine.kv.window_pool
        assert pool is not None and pool.num_blocks <= SPANNED + 2 + 32 // BLOCK
        tokens = rand_tokens(100, 14)
        sid = engine.create_session()
        engine.generate(sid, tokens, GenerateOptions(max_tokens=0)).result()
        for seed in range(3):  # others take every free window block, evicting the cached ones
            prompt_logprobs(engine, rand_tokens(60, 20 + seed))
        engine.truncate_session(sid, 40)
        tail = rand_tokens(20, 15)
        opts = GenerateOptions(max_tokens=0, logprob_ranges=[(40, 60)])
        computed = engine.computed_tokens
        events, _ = engine.generate(sid, tail, opts).result()
        assert engine.computed_tokens - computed > 20  # more than the tail: computed again
        expected = hf_prompt_logprobs(hf, tokens[:40] + tail)[39:]
        assert (torch.tensor([e.logprob for e in events]) - expected).abs().max() <= 1e-4
    finally:
        engine.shutdown()


def test_the_fused_stack_keeps_local_layers_in_the_window_pool(tokenizer) -> None:
    """Quantised, Gemma 3 runs every step in the fused stack (kernels/decode_stack.h), which reads
    and writes the local layers' keys and values in the window pool: a session far past the
    window holds a window's worth of blocks there, and its tokens and logprobs are the eager
    layers' on the same cache layout (to 1e-4: the same matmuls, another order of sums; fp32
    activations both, as int8 ones turn the paths' fp32 order into whole rounding steps now and
    then: seen 3e-4 on the AVX2 build)."""
    from tests.model.test_quant import _twins
    from tokenwire.model.kernels import ops
    from tokenwire.model.quant import Q8_0

    model, _ = _twins(Q8_0, "gemma3")
    assert model.fusion_blocker is None
    tokens = rand_tokens(200, 16)
    greedy = SamplingParams(temperature=0.0)
    opts = GenerateOptions(max_tokens=40, sampling=greedy, ignore_eos=True, logprobs=True)
    runs = []
    ops().set_int16_activations(False)
    try:
        for fuse in (True, False):
            model.fuse_decode = fuse
            engine = Engine(model, tokenizer, name="tiny-gemma3-q8", block_size=BLOCK, max_batch_tokens=32,
                            kv_cache_mb=16, kv_dtype="fp32", speculate="off")  # fmt: skip
            try:
                assert engine.kv.window_pool is not None
                events, _ = engine.generate(engine.create_session(), tokens, opts).result()
                assert engine.stats()["kv_window_blocks_held"] <= SPANNED
                runs.append([(e.token_id, e.logprob) for e in events])
            finally:
                engine.shutdown()
    finally:
        ops().set_int16_activations(True)
    model.fuse_decode = True
    fused, eager = runs
    assert [t for t, _ in fused] == [t for t, _ in eager]
    assert max(abs(a - b) for (_, a), (_, b) in zip(fused, eager, strict=True)) <= 1e-4
