"""Gemma 3 (text): (1 + w) RMSNorms, also before and after attention and MLP and per head on q
and k; embeddings scaled by sqrt(hidden); q.k scaled by query_pre_attn_scalar^-1/2; GELU-tanh;
sliding-window layers (their own RoPE base) interleaved with global ones (theirs, with linear
scaling on the larger models); the final logits soft-capped where the config sets it."""

from __future__ import annotations

from typing import Any

from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError
from tokenwire.model.families.base import (
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    Family,
    GgufMeta,
    GgufNames,
    llama_names,
    qk_norm_names,
)
from tokenwire.model.layers.attention import Attention, AttentionSpec
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.mlp import GatedMLP
from tokenwire.model.layers.rotary import RopeSpec
from tokenwire.model.layers.weights import WeightNames


def _rope(config: ModelConfig, params: dict[str, Any]) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear"):
        raise UnsupportedArchitectureError(f"unsupported rope scaling {kind!r} in {config.architecture}")
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return RopeSpec.make(kind, float(params["rope_theta"]), config.head_dim, scaling)


def _layer_kinds(config: ModelConfig) -> list[str]:
    """transformers >= 5 lists them; older configs give a pattern (every sixth layer global)."""
    hf = config.hf
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern") or 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_layers)
    ]


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    hf = config.hf
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one rope setting per layer kind
        ropes = {kind: _rope(config, p) for kind, p in params.items()}
    else:
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
        ropes = {"sliding_attention": _rope(config, local), "full_attention": _rope(config, full)}
    scale = float(hf.get("query_pre_attn_scalar") or config.head_dim) ** -0.5
    layers = []
    for i, kind in enumerate(_layer_kinds(config)):
        spec = AttentionSpec(
            config.num_heads, config.num_kv_heads, config.head_dim, bias=config.attention_bias, qk_norm=True,
            window=int(hf["sliding_window"]) if kind == "sliding_attention" else None,
            scale=scale,  # no soft-cap: transformers' Gemma 3 never applies attn_logit_softcapping
        )  # fmt: skip
        attention = Attention(i, config.hidden_size, spec, config.rms_norm_eps, norm_offset=1.0)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        layers.append(DecoderLayer(i, config.hidden_size, attention, mlp, eps=config.rms_norm_eps,
                                   rope=ropes[kind], norm_offset=1.0, sandwich=True))  # fmt: skip
    return layers


def weight_names(config: ModelConfig) -> WeightNames:
    names = qk_norm_names(config, llama_names(config))
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attn_out_norm"] = (hf + "post_attention_layernorm",)
        names[ours + "mlp_norm"] = (hf + "pre_feedforward_layernorm",)
        names[ours + "mlp_out_norm"] = (hf + "post_feedforward_layernorm",)
    return names


def model_options(config: ModelConfig) -> dict[str, Any]:
    cap = config.hf.get("final_logit_softcapping")
    return {"embed_scale": config.hidden_size**0.5, "logit_softcap": cap, "norm_offset": 1.0}


def gguf_config(meta: GgufMeta) -> dict[str, Any]:
    """Gemma 3 as llama.cpp reads its GGUF: every `sliding_window_pattern`-th layer global (6
    where the file does not say; a list of booleans marks the sliding ones), local layers at
    `rope.freq_base_swa` (10,000 where unsaid) without scaling, and q.k scaled by head_dim^-1/2
    except on the 62-layer 27B, by (hidden / heads)^-1/2."""
    n, window = meta.need("block_count"), int(meta.get("attention.sliding_window") or 0)
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if not window:
        sliding = [False] * n
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    hidden, heads = meta.need("embedding_length"), meta.need("attention.head_count")
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 1e6))}
    if meta.get("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(meta.get("rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window or None,
        "query_pre_attn_scalar": hidden // heads if n == 62 else head_dim,
        "rope_parameters": {"sliding_attention": local, "full_attention": full},
        "rope_scaling": None,
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
    }


# llama.cpp's names for the sandwich norms; its converter stores each norm as 1 + w
GGUF = GgufNames(
    "gemma3", "gemma3_text", permuted_qk=False, norm_shift=1.0,
    layer={
        **GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
        **GGUF_QK_NORM_NAMES,
    },
    config=gguf_config,
)  # fmt: skip

FAMILY = Family(
    name="gemma3", architectures={"Gemma3ForCausalLM": "gemma3_text"}, assemble=assemble,
    weight_names=weight_names, model_options=model_options, gguf=GGUF,
)  # fmt: skip
