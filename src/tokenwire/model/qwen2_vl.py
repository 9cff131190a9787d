"""Qwen2-VL / Qwen2.5-VL: a Qwen2 decoder with multimodal rotary positions (M-RoPE) plus a vision tower.

The decoder layers are llama.py's (Qwen2: biased q/k/v, SwiGLU, RMSNorm); what differs is the
rotary embedding. Each token has three position ids (temporal, height, width) and the rotary
frequencies are split into `mrope_section` bands, band i rotating by position row i % 3. Text
tokens use the same id in all three rows. The k-th `<|image_pad|>` of an image whose merged grid
is h x w, and whose run starts at index s, gets (s', s' + k // w, s' + k % w) where s' = s plus
the shift of the images before it; the text after the image continues at s' + max(h, w), i.e.
every image shifts the later text positions by max(h, w) - h * w (transformers' get_rope_index).

The engine passes the slot positions (KV indices) as for any model and, for sequences with
images, the three-row rotary positions and the image embeddings of the pad rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenwire.model.config import ModelConfig
from tokenwire.model.llama import (
    AttentionBackend,
    LlamaModel,
    PagedDecode,
    build_model,
    rms_norm,
    rope_inv_freq,
)
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


class Qwen2VLModel(LlamaModel):
    """The decoder (LlamaModel's layers) with M-RoPE, and the vision tower as `.visual`."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        if config.vision is None or config.mrope_section is None:
            raise ValueError(f"{config.architecture} config has no vision_config / mrope_section")
        self.visual = VisionTower(config.vision)
        self.init_tables()

    def finish_build(self, device: str | torch.device) -> None:
        self.init_tables()
        # the 1-D table of LlamaModel is unused here; an empty module keeps the attribute valid
        self.rotary = nn.Module()

    def init_tables(self) -> None:
        """M-RoPE tables (plain CPU tensors, rebuilt after a meta-device construction)."""
        sections = self.config.mrope_section
        assert sections is not None
        half = self.config.head_dim // 2
        if sum(sections) != half:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {half}")
        with torch.device("cpu"):
            # which position row (t, h, w) rotates each frequency
            self.mrope_rows = torch.cat(
                [torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(sections)]
            )
            self.mrope_inv_freq = rope_inv_freq(self.config)
            self.mrope_sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.visual.init_tables()

    @property
    def can_fuse_decode(self) -> bool:
        return False  # the fused decode kernel knows only 1-D RoPE

    def rope_tables(self, pos3: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin [N, 1, head_dim] for [3, N] positions (fp32 angles, as the reference)."""
        rows = pos3.cpu()[self.mrope_rows]  # [head_dim / 2, N]
        freqs = rows.T.float() * self.mrope_inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin() * self.mrope_sign
        return cos[:, None].to(self.device, dtype), sin[:, None].to(self.device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend | PagedDecode,
        capture_layers: tuple[int, ...] = (),
        capture_index: torch.Tensor | None = None,
        mrope: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """LlamaModel.forward, plus `mrope` [3, N] rotary positions (None: text only, the slot
        positions in every row) and `image_embeds` replacing the token embeddings at `image_rows`."""
        if isinstance(attention, PagedDecode):
            raise ValueError("Qwen2-VL runs through the paged attention backend, not the fused decode")
        x = self.embed(input_ids)
        if image_rows is not None and image_embeds is not None and image_rows.numel():
            x = x.index_copy(0, image_rows.to(x.device), image_embeds.to(x.device, x.dtype))
        cos, sin = self.rope_tables(mrope if mrope is not None else positions.expand(3, -1), x.dtype)
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int, h: torch.Tensor) -> None:
            if layer in capture_layers:
                captured[layer] = h if capture_index is None else h[capture_index]

        capture(0, x)
        last = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention)
            if i + 1 < last:
                capture(i + 1, x)
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        capture(last, x)
        return x, captured

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """transformers >= 5 names (model.language_model.*, model.visual.*) or the published
        checkpoints' (model.*, visual.*)."""
        text: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if key.startswith("model.language_model."):
                text["model." + key[len("model.language_model.") :]] = value
            elif key.startswith("model.") and not key.startswith("model.visual."):
                text[key] = value
            elif key == "lm_head.weight":
                text[key] = value
        super().load_hf_state_dict(text)
        prefix = "model.visual." if any(k.startswith("model.visual.") for k in state) else "visual."
        self.visual.load_hf_state_dict(state, prefix)


def build_vl_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> Qwen2VLModel:
    model = build_model(
        config, state, dtype=dtype, device=device, max_positions=max_positions, model_class=Qwen2VLModel
    )
    assert isinstance(model, Qwen2VLModel)
    return model
