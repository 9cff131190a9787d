"""Attention over the paged KV cache for one packed model step.

The step's tokens are split into groups that share a query length: all decode tokens form
one group (one query each), each prefill chunk forms its own. For a group of B sequences we
gather their blocks into [B, L, kv_heads, D] keys/values and run one SDPA call with a mask
built once per step. Grouped-query heads are folded into the query length so keys are never
repeated per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenwire.engine.kv_cache import KVCache


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] rows of the packed batch (padding points at row 0)
    valid: torch.Tensor  # [B, Q] bool, False for padding
    block_table: torch.Tensor  # [B, n_blocks] (padding blocks point at block 0)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True where the query may attend
    contiguous_start: int | None = None  # single sequence whose blocks are consecutive


def build_group(
    rows: list[list[int]],
    starts: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
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
    key_pos = torch.arange(length)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    mask[:, :, 0] |= ~valid  # padding queries attend to something, so SDPA gives no NaN
    contiguous = None
    if b == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + len(tables[0]))):
        contiguous = tables[0][0]
    return AttentionGroup(
        token_index.to(device),
        valid.to(device),
        table.to(device),
        mask[:, None].to(device),
        contiguous,
    )


class PagedAttention:
    def __init__(self, kv: KVCache, slot_mapping: torch.Tensor, groups: list[AttentionGroup]) -> None:
        self.kv = kv
        self.slot_mapping = slot_mapping
        self.groups = groups

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, heads, d = q.shape
        kv_heads = k.shape[1]
        rep = heads // kv_heads
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.view(-1, kv_heads, d).index_copy_(0, self.slot_mapping, k)
        v_cache.view(-1, kv_heads, d).index_copy_(0, self.slot_mapping, v)
        out = torch.empty(n, heads * d, dtype=q.dtype, device=q.device)
        for g in self.groups:
            b, qlen = g.token_index.shape
            n_blocks = g.block_table.shape[1]
            if g.contiguous_start is not None:
                # one sequence with consecutive blocks: a view, no gather copy
                s = g.contiguous_start
                keys = k_cache[s : s + n_blocks].reshape(1, -1, kv_heads, d)
                values = v_cache[s : s + n_blocks].reshape(1, -1, kv_heads, d)
            else:
                keys = k_cache[g.block_table].view(b, -1, kv_heads, d)
                values = v_cache[g.block_table].view(b, -1, kv_heads, d)
            length = keys.shape[1]
            # [B, Q, KVH, rep, D] -> [B, KVH, rep*Q, D]: each kv head serves rep*Q query rows
            qg = q[g.token_index].view(b, qlen, kv_heads, rep, d).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(b, kv_heads, rep * qlen, d)
            mask = g.mask.expand(b, rep, qlen, length).reshape(b, 1, rep * qlen, length)
            o = F.scaled_dot_product_attention(
                qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
            )
            o = o.view(b, kv_heads, rep, qlen, d).permute(0, 3, 1, 2, 4).reshape(b, qlen, heads * d)
            if qlen == 1 or bool(g.valid.all()):
                out[g.token_index.view(-1)] = o.reshape(-1, heads * d)
            else:
                out[g.token_index[g.valid]] = o[g.valid]
        return out
