"""OLMoE: RMSNorm over the whole q and k projections (not per head), and a mixture of experts for
every MLP (top-k weights as the router gives them unless `norm_topk_prob`)."""

from __future__ import annotations

from typing import Any

from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError, common_config
from tokenwire.model.families import experts
from tokenwire.model.families.base import (
    GGUF_EXPERT_NAMES,
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    Family,
    GgufMeta,
    GgufNames,
    llama_layer,
    llama_names,
    qk_norm_names,
)
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.weights import WeightNames


def read_config(d: dict[str, Any], arch: str) -> ModelConfig:
    if d.get("clip_qkv") is not None:
        raise UnsupportedArchitectureError(f"clip_qkv in {arch}: tokenwire does not clip q/k/v")
    return common_config(d, arch)


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    hf = config.hf
    n, k, norm = experts.count(config), int(hf["num_experts_per_tok"]), bool(hf.get("norm_topk_prob"))
    return [
        llama_layer(
            config,
            i,
            mlp=experts.moe(config, config.intermediate_size, n, k, norm),
            qk_norm=True,
            qk_norm_per_head=False,
        )
        for i in range(config.num_layers)
    ]


def weight_names(config: ModelConfig) -> WeightNames:
    names = qk_norm_names(config, llama_names(config))
    for i in range(config.num_layers):
        experts.expert_names(config, names, i)
    return names


def gguf_config(meta: GgufMeta) -> dict[str, object]:
    entries = experts.gguf_config(meta, normalize=False)  # llama.cpp keeps OLMoE's raw top-k weights
    # every layer is sparse; OLMoE's config calls each expert's width intermediate_size
    return {**entries, "intermediate_size": entries.pop("moe_intermediate_size")}


# the q/k norms (over whole projections here), experts stacked; rows as they are
GGUF = GgufNames(
    "olmoe", "olmoe", permuted_qk=False, experts=True,
    layer={**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES, **GGUF_EXPERT_NAMES},
    config=gguf_config,
)  # fmt: skip

FAMILY = Family(
    name="olmoe", architectures={"OlmoeForCausalLM": "olmoe"}, assemble=assemble, weight_names=weight_names,
    read_config=read_config, prepare=experts.prepare, gguf=GGUF,
)  # fmt: skip
