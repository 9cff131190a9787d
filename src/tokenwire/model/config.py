"""Model configuration: what every family's stack needs from a Hugging Face config.json.

The fields every decoder has are read here (`common_config`); a family reads its own keys from
`hf`, the config as read, when it assembles its layers (model/families/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not one tokenwire implements."""


@dataclass
class ModelConfig:
    architecture: str  # Hugging Face architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # llama3 scaling parameters, or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # vision-language models only: M-RoPE's (temporal, height, width) frequency sections and the
    # vision tower's settings (a qwen2_vl_config.VisionConfig)
    mrope_section: tuple[int, ...] | None = None
    vision: Any = None
    hidden_act: str = "silu"
    hf: dict[str, Any] = field(default_factory=dict)  # the (text) config as read


def common_config(d: dict[str, Any], arch: str, rope_kinds: tuple[str, ...] = ("llama3",)) -> ModelConfig:
    """The fields every decoder has; `rope_kinds`: the rope scalings the family implements."""
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    # transformers >= 5 nests rope settings under rope_parameters; older configs keep
    # rope_theta and rope_scaling at the top level.
    rope_params = d.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or None
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = dict(rope_params)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in rope_kinds:
            raise UnsupportedArchitectureError(
                f"unsupported rope scaling {kind!r} in {arch}: tokenwire implements "
                f"{' and '.join(rope_kinds)} scaling here"
            )
    eos = d.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"),
        hf=dict(d),
    )
