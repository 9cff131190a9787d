"""Model configuration: the subset of a Hugging Face config.json our Llama-family code needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenwire.model import qwen2_vl_config as vl

# Hugging Face architecture name -> our family tag. Everything here shares one forward pass
# (RMSNorm, RoPE, GQA, SwiGLU); they differ only in the flags carried by ModelConfig.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    # vision-language: a Qwen2 decoder with M-RoPE plus a vision tower (qwen2_vl_config.py)
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}


MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


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

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        model_type = str(d.get("model_type", "unknown"))
        arch = archs[0] if archs else MODEL_TYPES.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported model architecture {arch!r}: tokenwire implements "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if SUPPORTED_ARCHITECTURES[arch] in ("qwen2_vl", "qwen2_5_vl"):
            text = cls.from_hf_dict(vl.text_config_dict(d))
            text.architecture = arch
            text.mrope_section = vl.mrope_section(d)
            text.vision = vl.vision_config(d, SUPPORTED_ARCHITECTURES[arch])
            return text
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
            elif kind != "llama3":
                raise UnsupportedArchitectureError(
                    f"unsupported rope scaling {kind!r} in {arch}: tokenwire implements llama3 scaling"
                )
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
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
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))
