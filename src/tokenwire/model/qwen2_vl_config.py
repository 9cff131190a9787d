"""Qwen2-VL / Qwen2.5-VL config.json: the text decoder's ModelConfig plus the vision tower's settings.

Two layouts exist: transformers >= 5 nests the decoder under `text_config` (rope settings under
`rope_parameters`), checkpoints published before keep the decoder's keys at the top level with
`rope_scaling = {"type": "mrope", "mrope_section": [...]}`. Both are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VISION_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
VISION_MODEL_TYPES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (ViT + 2x2 patch merger) and the image token ids of a Qwen2-VL model."""

    variant: str  # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    width: int  # the ViT's hidden size (Qwen2-VL's embed_dim)
    num_heads: int
    mlp_hidden: int  # fc1 / gate-up width
    out_hidden: int  # the decoder's hidden size: what the merger produces
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    window_size: int  # Qwen2.5-VL windowed attention, in pixels (0: every layer full)
    fullatt_blocks: tuple[int, ...]  # Qwen2.5-VL layers with full attention
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def text_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The decoder's settings as a flat Qwen2-style dict (what config.common_config reads)."""
    text = dict(d.get("text_config") or d)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in d and key not in text:
            text[key] = d[key]
    if "tie_word_embeddings" in d:  # the top level decides (lm_head is outside the text model)
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    text["architectures"] = ["Qwen2ForCausalLM"]
    # M-RoPE is the decoder's own rotary scheme (handled by families/qwen2_vl.py), not a length scaling
    for key in ("rope_scaling", "rope_parameters"):
        params = text.get(key)
        if isinstance(params, dict) and "mrope_section" in params:
            text[key] = {k: v for k, v in params.items() if k not in ("mrope_section", "type", "rope_type")}
    return text


def mrope_section(d: dict[str, Any]) -> tuple[int, ...]:
    text = d.get("text_config") or d
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key) or d.get(key) or {}
        if "mrope_section" in params:
            return tuple(int(x) for x in params["mrope_section"])
    return (16, 24, 24)  # transformers' default for these models


def vision_config(d: dict[str, Any], variant: str) -> VisionConfig:
    v = d["vision_config"]
    rope = v.get("rope_parameters") or {}
    text_hidden = int((d.get("text_config") or d)["hidden_size"])
    if variant == "qwen2_vl":
        width = int(v.get("embed_dim", 1280))
        mlp_hidden = int(width * float(v.get("mlp_ratio", 4)))
        out_hidden = int(v.get("hidden_size", text_hidden))
        act = v.get("hidden_act", "quick_gelu")
        window, full = 0, ()
    else:
        width = int(v.get("hidden_size", 1280))
        mlp_hidden = int(v.get("intermediate_size", 3420))
        out_hidden = int(v.get("out_hidden_size", text_hidden))
        act = v.get("hidden_act", "silu")
        window = int(v.get("window_size", 112))
        full = tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
    return VisionConfig(
        variant=variant,
        depth=int(v.get("depth", 32)),
        width=width,
        num_heads=int(v.get("num_heads", 16)),
        mlp_hidden=mlp_hidden,
        out_hidden=out_hidden,
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=str(act),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=window,
        fullatt_blocks=full,
        image_token_id=int(d.get("image_token_id", 151655)),
        vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
    )
