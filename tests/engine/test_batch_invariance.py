"""A request's tokens and logprobs are the same bits whatever runs beside it or how its prompt is
cut: alone, in a batch of 32, prefilled in one chunk or many, after a prefix-cache hit, after
preemption. Every step of a quantised model runs one arithmetic (the fused stack, int16
activations summed per row in one order: kernels/matvec.h), so nothing here has a tolerance."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.engine.test_engine_parity import GREEDY, rand_tokens
from tests.tiny_models import hf_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import GenerateOptions, TokenEvent, iter_events
from tokenwire.model.families import build_model, experts, read_config
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import Q4_1

Run = list[tuple[int, float]]
OPTS = GenerateOptions(max_tokens=12, ignore_eos=True, sampling=GREEDY, logprobs=True)


def _tiny_quantised(arch: str = "smollm2") -> torch.nn.Module:
    hf = hf_model(arch)
    config = read_config(hf.config.to_dict())
    state = dict(experts.renamed(dict(hf.state_dict()), experts.count(config)))
    tensors, qtypes = quantize_state(state, Q4_1)
    return build_model(config, tensors, qtypes)


def _smollm2() -> torch.nn.Module:
    from tokenwire.engine.factory import load_model
    from tokenwire.model.loader import resolve_model

    return load_model(resolve_model(None), "gguf", torch.device("cpu"), None)


# OLMoE's tiny twin: each token's experts in the fused stack (its 4 experts, 2 a token, in a
# batch of 32 mixing every routing), summed the same whatever shares the step; Gemma 3's: its
# local layers (window 8) read from the window pool, where a 45-token prompt passes the window
MODELS = {
    "smollm2": _smollm2,
    "tiny": _tiny_quantised,
    "tiny-olmoe": lambda: _tiny_quantised("olmoe"),
    "tiny-gemma3": lambda: _tiny_quantised("gemma3"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> torch.nn.Module:
    built = MODELS[request.param]()
    assert built.can_fuse_decode  # every step of it runs the fused stack
    return built


def _run(engine: Engine, prompt: list[int], opts: GenerateOptions = OPTS) -> Run:
    events, _ = engine.generate(None, prompt, opts).result()
    return [(e.token_id, e.logprob) for e in events]


def test_alone_in_a_batch_of_32_and_chunked_prefill_give_the_same_bits(model, tokenizer) -> None:
    prompt = rand_tokens(45, 1)
    engine = Engine(model, tokenizer, name="m", kv_cache_mb=64)
    try:
        alone = _run(engine, prompt, GenerateOptions(**{**OPTS.__dict__, "use_prefix_cache": False}))
        others = [rand_tokens(5 + 3 * i, 100 + i) for i in range(31)]
        held, go = threading.Event(), threading.Event()
        engine.call_on_model_thread(lambda: (held.set(), go.wait(30)))  # all 32 start together
        held.wait(30)
        handles = [engine.generate(None, p, OPTS) for p in [*others[:15], prompt, *others[15:]]]
        go.set()
        batch = [[(e.token_id, e.logprob) for e in h.result()[0]] for h in handles]
        assert batch[15] == alone
        # the same prompt again: its first 32 tokens' KV from the prefix cache
        assert _run(engine, prompt) == alone
    finally:
        engine.shutdown()
    chunked = Engine(model, tokenizer, name="m", kv_cache_mb=64, max_batch_tokens=7)
    try:  # the prompt prefilled 7 tokens a step, sharing steps with another request
        other = chunked.generate(None, rand_tokens(30, 9), OPTS)
        assert _run(chunked, prompt) == alone
        other.result()
    finally:
        chunked.shutdown()


def test_a_preempted_request_recomputes_the_same_bits(model, tokenizer) -> None:
    per_block = KVCache.bytes_per_block(model.config, 16, "fp16")  # auto for quantised weights
    engine = Engine(model, tokenizer, name="m", kv_cache_mb=8 * per_block / 2**20)  # 8 blocks
    assert engine.kv.num_blocks == 8
    try:
        batch_prompt, urgent_prompt = rand_tokens(40, 70), rand_tokens(90, 71)
        batch_opts = GenerateOptions(**{**OPTS.__dict__, "max_tokens": 40, "priority": 10})
        alone = _run(engine, batch_prompt, batch_opts)
        batch = engine.generate(None, batch_prompt, batch_opts)
        events = iter_events(batch)
        first = next(events)  # decoding now, holding 3 blocks; the urgent prompt needs 6
        rest: Run = []
        done: list[str] = []

        def read_rest() -> None:
            rest.extend((e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent))
            done.append("batch")

        reader = threading.Thread(target=read_rest)
        reader.start()
        urgent = GenerateOptions(max_tokens=4, ignore_eos=True, sampling=GREEDY, priority=0)
        engine.generate(None, urgent_prompt, urgent).result()
        done.append("urgent")
        reader.join(timeout=60)
        assert done == ["urgent", "batch"]  # the urgent one could only run by preempting it
        assert [(first.token_id, first.logprob), *rest] == alone
    finally:
        engine.shutdown()
