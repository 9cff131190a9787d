"""Our forward pass against transformers' with the same random weights: an exact oracle."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import TINY_CONFIGS, hf_model, ours_from_hf
from tokenwire.model.config import UnsupportedArchitectureError
from tokenwire.model.families import read_config
from tokenwire.model.layers.attention import DenseCausalAttention


def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    positions = torch.arange(t).repeat(b)
    with torch.inference_mode():
        hidden, _ = model(ids.reshape(-1), positions, DenseCausalAttention(b, t))
        return model.logits(hidden).view(b, t, -1)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_logits_match_transformers(arch: str) -> None:
    hf = hf_model(arch)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 49152, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(ids).logits
    got = dense_logits(ours, ids)
    assert (got - expected).abs().max().item() <= 1e-4


def test_qwen2_has_qkv_bias_and_tied_embeddings_follow_config() -> None:
    qwen = read_config(TINY_CONFIGS["qwen2"].to_dict())
    smol = read_config(TINY_CONFIGS["smollm2"].to_dict())
    assert qwen.attention_bias and not smol.attention_bias
    assert smol.tie_word_embeddings


def test_llama3_rope_scaling_is_parsed() -> None:
    cfg = read_config(TINY_CONFIGS["llama3"].to_dict())
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0


def test_unsupported_architecture_is_named() -> None:
    d = TINY_CONFIGS["llama2"].to_dict() | {"architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        read_config(d)
