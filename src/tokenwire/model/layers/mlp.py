"""Feed-forward blocks: a gated dense MLP and a mixture of experts over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# activation name in config.json -> the gate's function (the fused decode kernel's codes in
# `ACTIVATION_CODES`, model/layers/fusion.py)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {activation!r}: tokenwire implements {sorted(ACTIVATIONS)}"
            )
        self.activation = activation
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(ACTIVATIONS[self.activation](gate).mul_(up))


class MixtureOfExperts(nn.Module):
    """A router picks `top_k` of `num_experts` gated MLPs per token; each expert runs once per
    step on just the tokens routed to it, and their outputs are summed with the router's weights
    (softmax over all experts, then the top k, renormalised to sum 1 when `normalize`:
    Mixtral and Qwen3-MoE do, OLMoE does not)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, activation) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # only the experts some token was routed to
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out
