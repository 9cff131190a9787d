"""Qwen3: the Llama block without q/k/v bias and with an RMSNorm over each head of q and k."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import (
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    Family,
    GgufNames,
    llama_layer,
    llama_names,
    qk_norm_names,
    sliding_windows,
)
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.weights import WeightNames


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    windows = sliding_windows(config)
    return [llama_layer(config, i, qk_norm=True, window=windows[i]) for i in range(config.num_layers)]


def weight_names(config: ModelConfig) -> WeightNames:
    return qk_norm_names(config, llama_names(config))


# llama.cpp writes Qwen's q/k rows as they are (NEOX RoPE: no permutation) and the norms as
# attn_q_norm / attn_k_norm
GGUF = GgufNames(
    "qwen3", "qwen3", permuted_qk=False,
    layer={**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES},
)  # fmt: skip

FAMILY = Family(
    name="qwen3", architectures={"Qwen3ForCausalLM": "qwen3"}, assemble=assemble, weight_names=weight_names,
    gguf=GGUF,
)  # fmt: skip
