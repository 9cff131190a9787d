"""Qwen3: the Llama block without q/k/v bias and with an RMSNorm over each head of q and k."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import Family, llama_layer, llama_names, qk_norm_names, sliding_windows
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.weights import WeightNames


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    windows = sliding_windows(config)
    return [llama_layer(config, i, qk_norm=True, window=windows[i]) for i in range(config.num_layers)]


def weight_names(config: ModelConfig) -> WeightNames:
    return qk_norm_names(config, llama_names(config))


FAMILY = Family(
    name="qwen3", architectures={"Qwen3ForCausalLM": "qwen3"}, assemble=assemble, weight_names=weight_names
)
