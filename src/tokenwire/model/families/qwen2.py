"""Qwen2 / Qwen2.5: the Llama block with biased q/k/v; sliding windows on the layers from
`max_window_layers` on where `use_sliding_window` asks (transformers' Qwen2 rule)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenwire.model.config import ModelConfig, common_config
from tokenwire.model.families.base import Family, GgufNames, llama_layer, llama_names, sliding_windows
from tokenwire.model.layers.block import DecoderLayer


def read_config(d: dict[str, Any], arch: str) -> ModelConfig:
    return replace(common_config(d, arch), attention_bias=True)


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    windows = sliding_windows(config)
    return [llama_layer(config, i, window=windows[i]) for i in range(config.num_layers)]


FAMILY = Family(
    name="qwen2",
    architectures={"Qwen2ForCausalLM": "qwen2"},
    assemble=assemble,
    weight_names=llama_names,
    read_config=read_config,
    gguf=GgufNames("qwen2", "qwen2", permuted_qk=False),
)
