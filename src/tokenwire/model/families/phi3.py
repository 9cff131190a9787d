"""Phi-3 / Phi-4 (full rotary): the Llama block with checkpoints that fuse q/k/v and gate/up,
LongRoPE on the long-context models, and `sliding_window` on every layer where set."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError, common_config
from tokenwire.model.families.base import Family, llama_layer, sliding_windows
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.weights import WeightNames


def read_config(d: dict[str, Any], arch: str) -> ModelConfig:
    partial = float(
        (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    )
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"partial rotary embedding ({partial}) in {arch}: tokenwire rotates whole heads"
        )
    config = common_config(d, arch, rope_kinds=("llama3", "longrope"))
    if config.rope_scaling is None:
        return config
    # LongRoPE's attention factor comes from the trained length over the original one (rotary.py)
    lengths = {"max_position_embeddings": config.max_position_embeddings,
               "original_max_position_embeddings": d.get("original_max_position_embeddings")}  # fmt: skip
    return replace(config, rope_scaling={**lengths, **config.rope_scaling})


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    windows = sliding_windows(config, every_layer=True)
    return [llama_layer(config, i, window=windows[i]) for i in range(config.num_layers)]


def weight_names(config: ModelConfig) -> WeightNames:
    names: WeightNames = {"embed": ("model.embed_tokens",), "norm": ("model.norm",), "lm_head": ("lm_head",)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attn_norm"] = (hf + "input_layernorm",)
        names[ours + "attention.qkv"] = (hf + "self_attn.qkv_proj",)  # fused in the checkpoint
        names[ours + "attention.o_proj"] = (hf + "self_attn.o_proj",)
        names[ours + "mlp_norm"] = (hf + "post_attention_layernorm",)
        names[ours + "mlp.gate_up"] = (hf + "mlp.gate_up_proj",)
        names[ours + "mlp.down"] = (hf + "mlp.down_proj",)
    return names


FAMILY = Family(
    name="phi3", architectures={"Phi3ForCausalLM": "phi3"}, assemble=assemble, weight_names=weight_names,
    read_config=read_config,
)  # fmt: skip
