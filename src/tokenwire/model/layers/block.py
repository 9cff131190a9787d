"""One decoder layer: norm -> attention -> (norm) -> residual, norm -> MLP -> (norm) -> residual.

The bracketed norms are Gemma's "sandwich". Which attention, rotary table and MLP each layer has
is the family's choice (model/families/), made when it assembles the stack (decoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwire.model.layers.attention import Attention, AttentionBackend
from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.layers.rotary import RopeSpec, RopeTables


class DecoderLayer(nn.Module):
    def __init__(
        self, index: int, hidden: int, attention: Attention, mlp: nn.Module, *, eps: float,
        rope: RopeSpec, norm_offset: float = 0.0, sandwich: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.index = index
        self.rope = rope
        self.attn_norm = RMSNorm(hidden, eps, norm_offset)
        self.attention = attention
        self.attn_out_norm = RMSNorm(hidden, eps, norm_offset) if sandwich else None
        self.mlp_norm = RMSNorm(hidden, eps, norm_offset)
        self.mlp = mlp
        self.mlp_out_norm = RMSNorm(hidden, eps, norm_offset) if sandwich else None

    def forward(self, x: torch.Tensor, rope: RopeTables | None, backend: AttentionBackend) -> torch.Tensor:
        h = self.attention(self.attn_norm(x), rope, backend)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return x + h
