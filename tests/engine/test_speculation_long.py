"""Speculation at long context (issue 45): after an 8k-token prompt, guessed rows attend the
whole context beside the decode row, each chunk of the cache read once for the rows of one
sequence (kernels/paged_attention.h), and the guess policy charges each guessed row that
attention (engine/speculation.py's StepCost). Greedy tokens and logprobs stay the bits of one
token a step."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine_parity import GREEDY, rand_tokens
from tests.tiny_models import hf_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, TokenEvent
from tokenwire.model.families import build_model, read_config
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import Q4_1

CONTEXT = 8192


@pytest.fixture(scope="module")
def long_tiny() -> torch.nn.Module:
    """The tiny SmolLM2 (head size 16: the fused kernels' grouped paths) with an 8k context,
    quantised so steps run the fused stack, guessed rows included."""
    hf = hf_model("smollm2")
    tensors, qtypes = quantize_state(dict(hf.state_dict()), Q4_1)
    config = read_config({**hf.config.to_dict(), "max_position_embeddings": CONTEXT + 256})
    return build_model(config, tensors, qtypes)


def _run(engine: Engine, prompt: list[int]) -> list[tuple[int, float]]:
    opts = GenerateOptions(max_tokens=64, ignore_eos=True, sampling=GREEDY, logprobs=True)
    events, _ = engine.generate(None, prompt, opts).result()
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent) and not e.is_prefill]


def test_guesses_after_an_8k_prompt_give_the_bits_of_one_token_a_step(long_tiny, tokenizer) -> None:
    # a 500-token passage 16 times over: its n-grams have followers, so guesses are made
    prompt = (rand_tokens(500, 45) * 17)[:8000]
    kw = {"kv_cache_mb": 16, "max_model_len": CONTEXT + 256}
    on = Engine(long_tiny, tokenizer, name="on", speculate="ngram", **kw)
    off = Engine(long_tiny, tokenizer, name="off", speculate="off", **kw)
    try:
        assert on.step_model.can_fuse_decode  # the fused stack's attention, grouped rows and all
        with_guesses, without = _run(on, prompt), _run(off, prompt)
        assert len(without) == 64
        assert with_guesses == without  # token ids and logprobs, bit for bit
        stats = on.stats()
        assert stats["spec_proposed"] > 0 and stats["spec_accepted"] > 0
        assert stats["steps"] < off.stats()["steps"]  # kept guesses: fewer steps for the tokens
        assert off.stats()["spec_proposed"] == 0
    finally:
        on.shutdown()
        off.shutdown()
