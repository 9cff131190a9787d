"""Phi-3 / Phi-4 (full rotary): the Llama block with checkpoints that fuse q/k/v and gate/up,
LongRoPE on the long-context models, and `sliding_window` on every layer where set."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError, common_config
from tokenwire.model.families.base import (
    GGUF_LAYER_NAMES,
    Family,
    GgufMeta,
    GgufNames,
    llama_layer,
    sliding_windows,
)
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


def gguf_config(meta: GgufMeta) -> dict[str, Any]:
    """The window (0: none, Phi-4) and LongRoPE: llama.cpp's converter writes the factors as
    tensors and the attention factor it derived from the two lengths, which we derive again."""
    entries: dict[str, Any] = {"sliding_window": int(meta.get("attention.sliding_window") or 0) or None}
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        entries["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in meta.shapes:
        entries["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in meta.values("rope_factors_long.weight")],
            "short_factor": [float(f) for f in meta.values("rope_factors_short.weight")],
        }
    return entries


# llama.cpp keeps Phi-3's fused tensors: attn_qkv, and ffn_up holding gate and up; rows as they are
GGUF = GgufNames(
    "phi3", "phi3", permuted_qk=False,
    layer={**GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    config=gguf_config,
)  # fmt: skip

FAMILY = Family(
    name="phi3", architectures={"Phi3ForCausalLM": "phi3"}, assemble=assemble, weight_names=weight_names,
    read_config=read_config, gguf=GGUF,
)  # fmt: skip
