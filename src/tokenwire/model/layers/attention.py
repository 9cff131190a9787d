"""Attention: the q/k/v and output projections around a backend that owns the keys and values.

The layers work on a *packed* batch: the tokens of every sequence in a step are concatenated into
one [N, hidden] tensor, so projections run as single matmuls whatever mix of prefill chunks and
decode tokens the scheduler chose. Only attention itself needs to know which token belongs to
which sequence; it is delegated to an `AttentionBackend` (the engine's paged KV cache, or
`DenseCausalAttention` for whole-sequence tensor calls). A layer's window, soft-cap and scale are
properties of the layer (its `AttentionSpec`), handed to the backend with each call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.layers.rotary import RopeTables, apply_rope


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False  # on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_per_head: bool = True  # False: over the whole q and k projections (OLMoE)
    window: int | None = None  # a query sees at most this many positions, itself included
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    scale: float | None = None  # of q.k; None: 1 / sqrt(head_dim)

    def allowed(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[.., Q, K] True where a query at query_pos [.., Q] may see a key at key_pos [K]."""
        allowed = key_pos <= query_pos[..., None]
        if self.window is not None:
            allowed &= key_pos > query_pos[..., None] - self.window
        return allowed


class AttentionBackend(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] for the packed tokens -> attention output [N, H*D]."""
        ...


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: AttentionSpec
) -> torch.Tensor:
    """softmax(q.k * scale [soft-capped] + mask) v over [B, heads, rows, D] tensors; mask is a
    bool (True = may attend) or additive tensor broadcasting to [B, heads, rows, keys], None for
    plain causal attention over equal-length q and k."""
    if spec.softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    # SDPA has no soft-cap: the scores are written out (a soft-capped model's layers only)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return scores.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(
        self, index: int, hidden: int, spec: AttentionSpec, eps: float, norm_offset: float = 0.0
    ) -> None:
        super().__init__()
        self.index = index
        self.spec = spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q/k/v in one matmul: fewer kernel launches per token
        self.qkv = nn.Linear(hidden, q_size + 2 * kv_size, bias=spec.bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        q_width, k_width = (spec.head_dim, spec.head_dim) if spec.qk_norm_per_head else (q_size, kv_size)
        self.q_norm = RMSNorm(q_width, eps, norm_offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, norm_offset) if spec.qk_norm else None

    def forward(self, h: torch.Tensor, rope: RopeTables | None, backend: AttentionBackend) -> torch.Tensor:
        n, spec = h.shape[0], self.spec
        heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = self.qkv(h)
        q_size, kv_size, _ = self.split
        qk = qkv[:, : q_size + kv_size].view(n, heads + kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            if spec.qk_norm_per_head:
                qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
            else:
                q, k = self.q_norm(qkv[:, :q_size]), self.k_norm(qkv[:, q_size : q_size + kv_size])
                qk = torch.cat([q, k], dim=1).view(n, heads + kv_heads, d)
        if rope is not None:  # q and k heads get RoPE in one call
            qk = apply_rope(qk, *rope)
        v = qkv[:, q_size + kv_size :].view(n, kv_heads, d)
        return self.o_proj(backend(self.index, qk[:, :heads], qk[:, heads:], v, spec))


class DenseCausalAttention:
    """Whole-sequence causal attention over a [B, T] batch flattened to B*T packed tokens."""

    def __init__(
        self,
        batch: int,
        seq_len: int,
        key_mask: torch.Tensor | None = None,
        before_layer: Callable[[], None] | None = None,
        round_kv: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.batch = batch
        self.seq_len = seq_len
        # keys and values as a KV cache would store them (engine/kv_cache.py's as_stored), so a
        # dense pass attends to what the engine's steps attend to
        self.round_kv = round_kv
        # key_mask [B, T] (True = real token) supports right-padded batches.
        self.key_mask = key_mask
        # called as each layer's attention starts: may raise to abandon a long forward
        self.before_layer = before_layer

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer()
        b, t = self.batch, self.seq_len
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        if self.round_kv is not None:
            k, v = self.round_kv(k), self.round_kv(v)
        q4 = q.view(b, t, heads, d).transpose(1, 2)
        k4 = k.view(b, t, kv_heads, d).transpose(1, 2)
        v4 = v.view(b, t, kv_heads, d).transpose(1, 2)
        if kv_heads != heads:
            k4 = k4.repeat_interleave(heads // kv_heads, dim=1)
            v4 = v4.repeat_interleave(heads // kv_heads, dim=1)
        mask = None
        if self.key_mask is not None or spec.window is not None:
            pos = torch.arange(t, device=q.device)
            mask = spec.allowed(pos, pos)[None, None]
            if self.key_mask is not None:
                mask = mask & self.key_mask[:, None, None, :]
            mask = mask | torch.eye(t, dtype=torch.bool, device=q.device)[None, None]
        return attend(q4, k4, v4, mask, spec).transpose(1, 2).reshape(b * t, heads * d)
