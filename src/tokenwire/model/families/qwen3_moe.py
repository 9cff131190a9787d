"""Qwen3-MoE: Qwen3's attention (per-head q/k norm); a mixture of experts for the MLP of every
`decoder_sparse_step`-th layer not in `mlp_only_layers` (a dense MLP there)."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families import experts
from tokenwire.model.families.base import (
    GGUF_EXPERT_NAMES,
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


def _sparse(config: ModelConfig, i: int) -> bool:
    hf = config.hf
    step = int(hf.get("decoder_sparse_step") or 1)
    return i not in (hf.get("mlp_only_layers") or []) and experts.count(config) > 0 and (i + 1) % step == 0


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    hf, windows = config.hf, sliding_windows(config)
    layers = []
    for i in range(config.num_layers):
        mlp = None
        if _sparse(config, i):
            mlp = experts.moe(config, int(hf["moe_intermediate_size"]), experts.count(config),
                              int(hf["num_experts_per_tok"]), bool(hf.get("norm_topk_prob")))  # fmt: skip
        layers.append(llama_layer(config, i, mlp=mlp, qk_norm=True, window=windows[i]))
    return layers


def weight_names(config: ModelConfig) -> WeightNames:
    names = qk_norm_names(config, llama_names(config))
    for i in range(config.num_layers):
        if _sparse(config, i):
            experts.expert_names(config, names, i)
    return names


# Qwen3's names plus stacked experts; llama.cpp renormalises Qwen3-MoE's top-k weights
GGUF = GgufNames(
    "qwen3moe", "qwen3_moe", permuted_qk=False, experts=True,
    layer={**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES, **GGUF_EXPERT_NAMES},
    config=lambda meta: experts.gguf_config(meta, normalize=True),
)  # fmt: skip

FAMILY = Family(
    name="qwen3_moe", architectures={"Qwen3MoeForCausalLM": "qwen3_moe"}, assemble=assemble,
    weight_names=weight_names, prepare=experts.prepare, gguf=GGUF,
)  # fmt: skip
