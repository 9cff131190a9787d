"""RMSNorm in the two forms checkpoints use: `w * x̂` (Llama, Qwen) and `(1 + w) * x̂` (Gemma)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed by hand: on CPU this is several times faster than the fused fallback
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class RMSNorm(nn.Module):
    """`offset` 1.0 is Gemma's form, whose checkpoints store w - 1; the product is the same
    either way, so the fused decode kernel takes `scale()` and never knows which form it was."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def scale(self) -> torch.Tensor:
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)
