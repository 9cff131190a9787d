"""Attention over the paged KV cache for one packed model step.

The step's tokens are split into groups that share a query length: all decode tokens form
one group (one query each), each prefill chunk forms its own. For a group of B sequences we
gather their blocks into [B, L, kv_heads, D] keys/values and run one SDPA call with a mask
built once per step for each window the model's layers have (a window is a property of the
layer: `AttentionSpec.window`). Grouped-query heads are folded into the query length so keys are
never repeated per head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenwire.engine.kv_cache import KVCache
from tokenwire.model.layers.attention import AttentionSpec, attend


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] rows of the packed batch (padding points at row 0)
    valid: torch.Tensor  # [B, Q] bool, False for padding
    block_table: torch.Tensor  # [B * n_blocks] flattened (padding blocks point at block 0)
    n_blocks: int
    query_pos: torch.Tensor  # [B, Q] positions of the queries (padding: 0)
    length: int  # keys gathered per sequence: n_blocks * block_size
    rep: int  # query heads per KV head
    dtype: torch.dtype
    row_start: int | None = None  # rows are row_start .. row_start+B*Q-1 in order: slice, no gather
    contiguous_start: int | None = None  # single sequence whose blocks are consecutive: a view
    # window (None: causal) -> [B, 1, rep*Q, L] additive mask, 0 where the query may attend and
    # -inf elsewhere; built at a layer's first call with that window, reused by the others
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def bias(self, spec: AttentionSpec) -> torch.Tensor:
        bias = self.biases.get(spec.window)
        if bias is None:
            b, q = self.query_pos.shape
            allowed = spec.allowed(self.query_pos, torch.arange(self.length, device=self.query_pos.device))
            allowed[:, :, 0] |= ~self.valid  # padding queries attend to something: no NaN
            bias = torch.zeros(b, q, self.length, dtype=self.dtype, device=self.query_pos.device)
            bias.masked_fill_(~allowed, float("-inf"))
            # grouped-query heads are folded into the query axis as (rep, Q)
            bias = bias[:, None].expand(b, self.rep, q, self.length).reshape(b, 1, self.rep * q, self.length)
            self.biases[spec.window] = bias
        return bias


def build_group(
    rows: list[list[int]],
    starts: list[int],
    tables: list[list[int]],
    block_size: int,
    rep: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    """rows[i]: packed-batch rows of sequence i, at positions starts[i], starts[i]+1, ..."""
    b = len(rows)
    q = max(len(r) for r in rows)
    n_blocks = max(len(t) for t in tables)
    length = n_blocks * block_size
    token_index = torch.zeros(b, q, dtype=torch.long)
    valid = torch.zeros(b, q, dtype=torch.bool)
    table = torch.zeros(b, n_blocks, dtype=torch.long)
    query_pos = torch.zeros(b, q, dtype=torch.long)
    for i, (r, start, t) in enumerate(zip(rows, starts, tables, strict=True)):
        token_index[i, : len(r)] = torch.tensor(r)
        valid[i, : len(r)] = True
        table[i, : len(t)] = torch.tensor(t)
        query_pos[i, : len(r)] = torch.arange(start, start + len(r))
    flat_rows = [x for r in rows for x in r]
    row_start = None
    if all(len(r) == q for r in rows) and flat_rows == list(
        range(flat_rows[0], flat_rows[0] + len(flat_rows))
    ):
        row_start = flat_rows[0]
    contiguous = None
    if b == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + len(tables[0]))):
        contiguous = tables[0][0]
    return AttentionGroup(
        token_index.to(device),
        valid.to(device),
        table.view(-1).to(device),
        n_blocks,
        query_pos.to(device),
        length,
        rep,
        dtype,
        row_start,
        contiguous,
    )


class PagedAttention:
    """`windowed`: the slots and groups of the window pool's tables, for the layers the cache
    keeps there (KVCache.window_pool)."""

    def __init__(
        self,
        kv: KVCache,
        slot_mapping: torch.Tensor,
        groups: list[AttentionGroup],
        windowed: tuple[torch.Tensor, list[AttentionGroup]] | None = None,
    ) -> None:
        self.kv = kv
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.windowed = windowed

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        n, heads, d = q.shape
        kv_heads = k.shape[1]
        rep = heads // kv_heads
        slots, groups = self.slot_mapping, self.groups
        if self.windowed is not None and self.kv.windowed(layer):
            slots, groups = self.windowed
        self.kv.write(layer, slots, k, v)
        single = len(groups) == 1 and groups[0].row_start == 0
        out = None if single else torch.empty(n, heads * d, dtype=q.dtype, device=q.device)
        for g in groups:
            b, qlen = g.token_index.shape
            if g.contiguous_start is not None:  # a view where the cache is stored in q's dtype
                s = g.contiguous_start
                keys, values = self.kv.read(layer, slice(s, s + g.n_blocks), q.dtype)
            else:
                keys, values = self.kv.read(layer, g.block_table, q.dtype)
            keys, values = keys.reshape(b, -1, kv_heads, d), values.reshape(b, -1, kv_heads, d)
            if g.row_start is not None:
                qg = q[g.row_start : g.row_start + b * qlen].view(b, qlen, kv_heads, rep, d)
            else:
                qg = q[g.token_index].view(b, qlen, kv_heads, rep, d)
            # [B, Q, KVH, rep, D] -> [B, KVH, rep*Q, D]: each kv head serves rep*Q query rows
            qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, rep * qlen, d)
            o = attend(qg, keys.transpose(1, 2), values.transpose(1, 2), g.bias(spec), spec)
            o = o.view(b, kv_heads, rep, qlen, d).permute(0, 3, 1, 2, 4).reshape(b, qlen, heads * d)
            if single:
                return o.view(n, heads * d)
            assert out is not None
            if g.row_start is not None:
                out[g.row_start : g.row_start + b * qlen] = o.view(-1, heads * d)
            elif bool(g.valid.all()):
                out[g.token_index.view(-1)] = o.reshape(-1, heads * d)
            else:
                out[g.token_index[g.valid]] = o[g.valid]
        assert out is not None
        return out
