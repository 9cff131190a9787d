"""Mixtral: the Llama block with a mixture of experts for its MLP (top-k renormalised), and
`sliding_window` on every layer where set."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families import experts
from tokenwire.model.families.base import (
    GGUF_EXPERT_NAMES,
    GGUF_LAYER_NAMES,
    Family,
    GgufMeta,
    GgufNames,
    llama_layer,
    llama_names,
    sliding_windows,
)
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.weights import WeightNames


def _experts(config: ModelConfig) -> tuple[int, int]:
    return experts.count(config), int(config.hf["num_experts_per_tok"])


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    n, k = _experts(config)
    windows = sliding_windows(config, every_layer=True)
    return [
        llama_layer(
            config, i, mlp=experts.moe(config, config.intermediate_size, n, k, True), window=windows[i]
        )
        for i in range(config.num_layers)
    ]


def weight_names(config: ModelConfig) -> WeightNames:
    names = llama_names(config)
    for i in range(config.num_layers):
        experts.expert_names(config, names, i)
    return names


def gguf_config(meta: GgufMeta) -> dict[str, int]:
    used = meta.need("expert_used_count")
    return {"num_local_experts": meta.need("expert_count"), "num_experts_per_tok": used}


# llama.cpp writes Mixtral as a Llama ("llama", q/k rows interleaved) with experts stacked
GGUF = GgufNames(
    "llama", "mixtral", permuted_qk=True, layer={**GGUF_LAYER_NAMES, **GGUF_EXPERT_NAMES}, experts=True,
    config=gguf_config,
)  # fmt: skip

FAMILY = Family(
    name="mixtral", architectures={"MixtralForCausalLM": "mixtral"}, assemble=assemble,
    weight_names=weight_names, prepare=experts.prepare, gguf=GGUF,
)  # fmt: skip
