"""The shipped Q4_1 GGUF run as it is: same greedy text as the fp32 path, fused and eager decode
agree, and the resident weights stay near the file's size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.model.quant import QuantLinear, resident_bytes

PROMPTS = [  # the Foundation tests' fixed prompts and the engine benchmark's questions
    "What is the capital of France?",
    "Tell me a story about a robot.",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "What does a compiler do?",
]


@pytest.fixture(scope="module")
def engines(smollm2_engine):
    fp32 = build_engine(EngineSettings(progress=False, kv_cache_mb=64, weights="fp32"))
    eager = build_engine(EngineSettings(progress=False, kv_cache_mb=64, weights="gguf", compile=False))
    yield {"gguf": smollm2_engine, "fp32": fp32, "gguf-eager": eager}
    fp32.shutdown()
    eager.shutdown()


def _greedy(engine, text: str, n: int = 32) -> list[int]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    opts = GenerateOptions(max_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    events, _ = engine.generate(None, prompt, opts).result()
    return [e.token_id for e in events]


def test_default_engine_runs_the_gguf_blocks(smollm2_engine) -> None:
    model = smollm2_engine.model
    assert smollm2_engine.weights == "gguf" and model.can_fuse_decode
    assert all(isinstance(layer.mlp.gate_up, QuantLinear) for layer in model.layers)
    size = smollm2_engine.source.source.stat().st_size
    assert resident_bytes(model) <= 1.3 * size


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_32_tokens_equal_fp32_and_eager(engines, text: str) -> None:
    fused = _greedy(engines["gguf"], text)
    assert fused == _greedy(engines["fp32"], text)
    assert fused == _greedy(engines["gguf-eager"], text)


def test_quantised_weights_are_the_files_own_blocks(smollm2_source) -> None:
    """The quantised tensors as the GGUF holds them (q/k rows un-permuted like the fp32 path),
    read from the file; the conversion cache holds no weights."""
    from gguf import GGUFReader

    from tokenwire.model.gguf import unpermute_rope_rows
    from tokenwire.model.gguf_weights import GgufWeights

    assert not list(smollm2_source.model_dir.glob("*.safetensors"))
    blocks = GgufWeights(smollm2_source.source, smollm2_source.config)
    reader = GGUFReader(smollm2_source.source)
    by_name = {t.name: t for t in reader.tensors}
    down = by_name["blk.3.ffn_down.weight"]
    assert blocks.qtypes["model.layers.3.mlp.down_proj.weight"] == int(down.tensor_type)
    np.testing.assert_array_equal(blocks["model.layers.3.mlp.down_proj.weight"].numpy(), down.data)
    q = by_name["blk.3.attn_q.weight"]
    np.testing.assert_array_equal(
        blocks["model.layers.3.self_attn.q_proj.weight"].numpy(), unpermute_rope_rows(np.array(q.data), 9)
    )
    assert "model.norm.weight" not in blocks.qtypes and blocks["model.norm.weight"].dtype == torch.float32
