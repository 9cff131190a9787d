"""Qwen2-VL / Qwen2.5-VL: Qwen2's decoder with multimodal rotary positions (M-RoPE), beside a
vision tower (qwen2_vl_vision.py; its config in qwen2_vl_config.py).

Each token has three position ids (temporal, height, width) and the rotary frequencies are split
into `mrope_section` bands, band i rotating by position row i % 3. Text tokens use the same id in
all three rows. The k-th `<|image_pad|>` of an image whose merged grid is h x w, and whose run
starts at index s, gets (s', s' + k // w, s' + k % w) where s' = s plus the shift of the images
before it; the text after the image continues at s' + max(h, w), i.e. every image shifts the later
text positions by max(h, w) - h * w (transformers' get_rope_index). The engine passes the slot
positions (KV indices) as for any model and, for sequences with images, the three-row rotary
positions and the image embeddings of the pad rows (engine/vision.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from tokenwire.model import qwen2_vl_config as vl
from tokenwire.model.config import ModelConfig, common_config
from tokenwire.model.families.base import Family, llama_layer, llama_names
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.rotary import RopeSpec
from tokenwire.model.layers.weights import Tensors
from tokenwire.model.qwen2_vl_vision import VisionTower

# (index of the image's first pad token, merged grid height, merged grid width)
ImagePlacement = tuple[int, int, int]


def mrope_positions(positions: torch.Tensor, images: Sequence[ImagePlacement]) -> torch.Tensor:
    """The [3, N] rotary positions of tokens at (slot) `positions` of a sequence holding `images`
    (sorted by start, non-overlapping)."""
    pos = positions.long()
    out = pos.expand(3, -1).clone()
    shift = 0  # what the images so far take off the later text positions
    for start, h, w in images:
        n = h * w
        inside = (pos >= start) & (pos < start + n)
        if bool(inside.any()):
            k = pos[inside] - start
            base = start + shift
            out[0, inside] = base
            out[1, inside] = base + torch.div(k, w, rounding_mode="floor")
            out[2, inside] = base + k % w
        after = pos >= start + n
        shift += max(h, w) - n
        out[:, after] = (pos[after] + shift).expand(3, -1)
    return out


class Qwen2VLModel(DecoderModel):
    """The decoder, and the vision tower as `.visual`."""

    def __init__(
        self, config: ModelConfig, layers: list[DecoderLayer], max_positions: int | None = None
    ) -> None:
        super().__init__(config, layers, max_positions)
        if config.vision is None:
            raise ValueError(f"{config.architecture} config has no vision_config")
        self.visual = VisionTower(config.vision)


def read_config(d: dict[str, Any], arch: str) -> ModelConfig:
    text = common_config(vl.text_config_dict(d), arch)
    return replace(
        text, attention_bias=True, mrope_section=vl.mrope_section(d),
        vision=vl.vision_config(d, vl.VISION_ARCHITECTURES[arch]),
    )  # fmt: skip


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    rope = RopeSpec.make("mrope", config.rope_theta, config.head_dim, {"mrope_section": config.mrope_section})
    return [llama_layer(config, i, rope) for i in range(config.num_layers)]


def prepare(model: DecoderModel, state: Tensors, dtype: torch.dtype, device: torch.device) -> Tensors:
    """Loads the tower; the decoder's tensors under Qwen2's names. transformers >= 5 names them
    model.language_model.* and model.visual.*, the published checkpoints model.* and visual.*."""
    assert isinstance(model, Qwen2VLModel)
    prefix = "model.visual." if any(k.startswith("model.visual.") for k in state) else "visual."
    model.visual = model.visual.to_empty(device=device)
    model.visual.load_hf_state_dict(state, prefix)
    model.visual = model.visual.to(dtype)
    model.visual.init_tables()
    text: Tensors = {}
    for key, value in state.items():
        if key.startswith("model.language_model."):
            text["model." + key[len("model.language_model.") :]] = value
        elif (key.startswith("model.") and not key.startswith("model.visual.")) or key == "lm_head.weight":
            text[key] = value
    return text


FAMILY = Family(
    name="qwen2_vl",
    architectures={arch: model_type for model_type, arch in vl.VISION_MODEL_TYPES.items()},
    assemble=assemble,
    weight_names=llama_names,
    read_config=read_config,
    model_class=Qwen2VLModel,
    prepare=prepare,
)
