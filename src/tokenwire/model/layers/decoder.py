"""The decoder stack every family builds: embedding, layers (block.py), final norm, lm_head."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenwire.model.config import ModelConfig
from tokenwire.model.layers import fusion
from tokenwire.model.layers.attention import AttentionBackend
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.layers.rotary import RopeSpec, Rotary, make_rotary
from tokenwire.model.quant import QuantLinear


@dataclass
class PagedDecode:
    """A decode-only step over the paged KV cache, for the fused decode path: row m of the
    batch is one new token of its own sequence at positions[m]; block_tables[m] lists that
    sequence's KV blocks (padded). k/v are the whole caches [layers, blocks, block_size, kv_heads, D],
    in the cache's storage type (fp32, fp16, bf16, or int8 with its scales: engine/kv_cache.py).
    `window`: where the cache keeps windowed layers in a pool of their own (Gemma 3's local
    layers), that pool and each row's tables there, with every layer's place (layer_slots)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [M, max_blocks] int64
    k_scale: torch.Tensor | None = None  # a q8 cache's scales (engine/kv_cache.py)
    v_scale: torch.Tensor | None = None
    window: WindowPool | None = None


@dataclass
class WindowPool:
    """The window pool's caches, the rows' tables there, and layer_slots [layers] int64: s >= 0
    is layer s of the full-context cache, s < 0 layer -s - 1 of this pool (kernels/decode_stack.h)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [M, max_blocks] int64
    layer_slots: torch.Tensor


class DecoderModel(nn.Module):
    """`embed_scale` multiplies the embeddings (Gemma: sqrt(hidden)); `logit_softcap` caps the
    logits as cap * tanh(logits / cap) (where a family's config sets it); `norm_offset` 1: the
    final norm is Gemma's (1 + w) form."""

    def __init__(
        self, config: ModelConfig, layers: list[DecoderLayer], max_positions: int | None = None, *,
        embed_scale: float | None = None, logit_softcap: float | None = None, norm_offset: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = embed_scale
        self.logit_softcap = logit_softcap
        self.fuse_decode = True  # False: decode steps run eager (--no-compile, A/B tests)
        self.rope_specs = list(dict.fromkeys(layer.rope for layer in layers))
        self.rotaries: dict[RopeSpec, nn.Module | None] = {}  # finish_build's

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def finish_build(self, device: str | torch.device) -> None:
        """The rotary tables, exact fp32 (cast per call): after loading and any dtype cast
        (families.build_model calls it)."""
        # a plain dict, not submodules: the tables are rebuilt here after every cast, never cast
        with torch.device(device):
            self.rotaries = {spec: make_rotary(spec, self.max_positions) for spec in self.rope_specs}

    def embed_tokens(
        self, input_ids: torch.Tensor, rows: torch.Tensor | None, embeds: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if rows is not None and embeds is not None and rows.numel():  # an image's rows (Qwen2-VL)
            x = x.index_copy(0, rows.to(x.device), embeds.to(x.device, x.dtype))
        return x

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
        """Run the decoder over packed tokens.

        Returns the final normed hidden states [N, hidden] and, for each layer L in
        capture_layers, the residual stream after L blocks (0 = embeddings; the last layer
        after the final norm, as transformers' hidden_states[L]) at capture_index (all
        tokens when None). `mrope` [3, N]: M-RoPE positions (Qwen2-VL); `image_embeds` replace
        the token embeddings at `image_rows`.
        """
        x = self.embed_tokens(input_ids, image_rows, image_embeds)
        if isinstance(attention, PagedDecode):
            return self._decode_forward(x.contiguous(), attention, capture_layers, capture_index)
        rope_of = {
            spec: None if r is None else r.tables(positions, x.dtype, mrope)
            for spec, r in self.rotaries.items()
        }
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int, h: torch.Tensor) -> None:
            if layer in capture_layers:
                captured[layer] = h if capture_index is None else h[capture_index]

        capture(0, x)
        last = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope_of[layer.rope], attention)
            if i + 1 < last:
                capture(i + 1, x)
        x = self.norm(x)
        capture(last, x)  # like transformers' hidden_states[-1]: the final, normed states
        return x, captured

    def _decode_forward(
        self,
        x: torch.Tensor,
        batch: PagedDecode,
        capture_layers: tuple[int, ...],
        capture_index: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """forward for a decode-only step: the whole stack and the final norm in one kernel call
        (the rotary tables indexed there too), cut where a layer's output is captured."""
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int) -> None:
            if layer in capture_layers:  # a copy: the kernel updates x in place
                captured[layer] = (x if capture_index is None else x[capture_index]).clone()

        capture(0)
        last = len(self.layers)
        start = 0
        w = batch.window
        pool = (None,) * 6 if w is None else (w.layer_slots, w.k, w.v, w.k_scale, w.v_scale, w.block_tables)
        ropes = [rotary.half_tables(batch.positions) for rotary in self._fused_rotaries]
        cos, sin = [c for c, _ in ropes], [s for _, s in ropes]
        for end in sorted({i for i in capture_layers if 0 < i < last} | {last}):
            final = self.norm.scale() if end == last else None
            self._decode_stack.run(
                x,
                batch.k,
                batch.v,
                batch.k_scale,
                batch.v_scale,
                batch.positions,
                batch.block_tables,
                start,
                end,
                final,
                cos,
                sin,
                *pool,
            )
            capture(end)
            start = end
        return x, captured

    @property
    def can_fuse_decode(self) -> bool:
        """Whether decode-only steps may run the stack as one fused kernel (PagedDecode): every
        layer of a kind the kernel knows (`fusion_blocker`), and not turned off (`fuse_decode`,
        --no-compile)."""
        return self.fuse_decode and self.fusion_blocker is None

    @functools.cached_property
    def fusion_blocker(self) -> str | None:
        """Why decode steps run eager (None: they fuse). The layers do not change after loading:
        checked once, not on every step."""
        return fusion.blocker(list(self.layers), self.device, self.dtype)

    @functools.cached_property
    def _fused_rotaries(self) -> list[Rotary]:
        """The rotaries whose cos/sin each fused step hands the kernel, in its order (rope_order)."""
        return [self.rotaries[spec] for spec in fusion.rope_order(self.rotaries)]  # type: ignore[misc]

    @functools.cached_property
    def _decode_stack(self) -> Any:
        """The fused decode kernel's handle on every layer's weights (built at the first fused step)."""
        return fusion.build_stack(list(self.layers), self.rotaries, self.norm.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # the head's input takes the finer activations (QuantLinear.forward's `wide`)
        head = self.lm_head
        out = (head(hidden, wide=True) if isinstance(head, QuantLinear) else head(hidden)).float()
        if self.logit_softcap is not None:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out
