"""One model step: which tokens of which requests run, and the tensors that describe them."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from tokenwire.engine.attention import AttentionGroup, PagedAttention, build_group
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.positions import ChunkRows
from tokenwire.engine.request import Request
from tokenwire.engine.step_team import StepTeam
from tokenwire.engine.vision import EmbeddingCache, step_inputs
from tokenwire.model import kernels
from tokenwire.model.layers.decoder import PagedDecode, WindowPool


@dataclass
class StepItem:
    request: Request
    start: int  # first position computed in this step
    count: int  # positions [start, start+count)
    rows: ChunkRows  # whose logits / hidden states the step returns: request.positions.rows()
    # guessed tokens after the session's last one (engine/speculation.py): positions
    # len(tokens) .. start+count-1 run these, and the logits of every row from the last token on
    # come back to be verified
    draft: list[int] = field(default_factory=list)
    guessed: int = 0  # how many of `draft` are the speculator's own (the rest: a constraint's forced span)


@dataclass
class RowStats:
    max_logit: float
    argmax: int
    logsumexp: float | None  # only for rows that report logprobs


@dataclass
class StepOutput:
    logits: dict[tuple[int, int], torch.Tensor]  # (request id, position) -> logits [vocab]
    hidden: dict[tuple[int, int], torch.Tensor]  # (request id, position) -> [n_layers, hidden]
    # (request id, position) -> (max logit, its token, logsumexp): reduced once for the whole
    # step, so greedy sampling and top-1 logprobs need no per-row pass over the vocabulary
    stats: dict[tuple[int, int], RowStats] = field(default_factory=dict)


def run_step(
    model: torch.nn.Module,
    kv: KVCache,
    items: list[StepItem],
    capture_layers: tuple[int, ...],
    vision: EmbeddingCache | None = None,
    team: StepTeam | None = None,
) -> StepOutput:
    device = kv.k.device
    dtype = model.dtype
    rep = model.config.num_heads // model.config.num_kv_heads
    bs = kv.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    window_slots: list[int] = []  # the same positions in the window pool (kv.window_pool)
    decode_rows: list[list[int]] = []
    decode_starts: list[int] = []
    decode_tables: list[tuple[list[int], list[int]]] = []  # full-context and window blocks
    item_tables: list[tuple[list[int], list[int], int]] = []  # each item's blocks (both pools), rows: fused
    chunks: list[tuple[list[int], int, list[int], list[int]]] = []  # prefill chunks: rows, start, tables
    logit_rows: list[int] = []
    logit_keys: list[tuple[int, int]] = []
    stat_rows: list[tuple[int, bool]] = []  # (index into logit rows, wants logprobs)
    capture_rows: list[int] = []
    capture_keys: list[tuple[int, int]] = []
    for item in items:
        session = item.request.session
        base = len(ids)
        table, window_table = session.block_table, session.window_table
        known = len(session.tokens)
        for p in range(item.start, item.start + item.count):
            ids.append(session.tokens[p] if p < known else item.draft[p - known])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if window_table:
                window_slots.append(window_table[p // bs] * bs + p % bs)
        rows = list(range(base, base + item.count))
        n_blocks = -(-(item.start + item.count) // bs)
        blocks = table[:n_blocks]
        # blocks the window has left read block 0: the window's mask hides their positions
        window_blocks = [max(b, 0) for b in window_table[:n_blocks]]
        item_tables.append((blocks, window_blocks, item.count))
        if item.count == 1:
            decode_rows.append(rows)
            decode_starts.append(item.start)
            decode_tables.append((blocks, window_blocks))
        else:
            chunks.append((rows, item.start, blocks, window_blocks))
        rid = item.request.id
        opts = item.request.options
        for p in item.rows.logits:
            sampled = p == item.rows.sample or bool(item.draft)  # a draft's every row is sampled
            if sampled and (opts.sampling.temperature == 0 or opts.logprobs):
                stat_rows.append((len(logit_rows), opts.logprobs))
            logit_rows.append(base + p - item.start)
            logit_keys.append((rid, p))
        for p in item.rows.capture:
            capture_rows.append(base + p - item.start)
            capture_keys.append((rid, p))
    attention: PagedAttention | PagedDecode
    position_tensor = torch.tensor(positions, device=device)
    if model.can_fuse_decode:
        # every step, decode rows and prefill chunks alike, runs the stack as one fused kernel
        # that reads the block tables itself (a row per token: its position, its sequence's
        # table). One kernel for every step is what keeps a token's arithmetic the same whether
        # it was decoded, prefilled in one chunk or several, alone or in a batch.
        tables = _row_tables([(t, n) for t, _, n in item_tables])
        window = None
        if kv.window_pool is not None:
            pool = kv.window_pool
            window_tables = _row_tables([(w, n) for _, w, n in item_tables])
            window = WindowPool(pool.k, pool.v, pool.k_scale, pool.v_scale, window_tables, kv.layer_slots)
        attention = PagedDecode(kv.k, kv.v, position_tensor, tables, kv.k_scale, kv.v_scale, window)
    else:

        def groups_of(pool: int) -> list[AttentionGroup]:
            groups = [build_group([r], [start], [t[pool]], bs, rep, device, dtype) for r, start, *t in chunks]
            if decode_rows:
                tables = [t[pool] for t in decode_tables]
                groups.append(build_group(decode_rows, decode_starts, tables, bs, rep, device, dtype))
            return groups

        windowed = None
        if kv.window_pool is not None:
            windowed = (torch.tensor(window_slots, device=device), groups_of(1))
        attention = PagedAttention(kv, torch.tensor(slots, device=device), groups_of(0), windowed)
    capture_index = torch.tensor(capture_rows, dtype=torch.long, device=device) if capture_rows else None
    # vision models: M-RoPE positions and the image embeddings of pad rows (engine/vision.py)
    extra = {}
    if vision is not None:
        extra = step_inputs(model, vision, [(i.request.session, i.start, i.count) for i in items])
    # the fused stack sizes its own team (kernels/barrier.h); other steps ask `team`
    fused = isinstance(attention, PagedDecode)
    sized = team.step(len(ids)) if team is not None and not fused else nullcontext()
    with torch.inference_mode(), sized:
        hidden, captured = model(
            torch.tensor(ids, device=device),
            position_tensor,
            attention,
            capture_layers if capture_rows else (),
            capture_index,
            **extra,
        )
        if logit_rows == list(range(len(ids))):  # decode steps: every row, in order
            rows = hidden
        else:
            rows = hidden[torch.tensor(logit_rows, dtype=torch.long, device=device)]
        logits = model.logits(rows).cpu()
    out_logits = {key: logits[i] for i, key in enumerate(logit_keys)}
    out_hidden: dict[tuple[int, int], torch.Tensor] = {}
    if capture_rows:
        stacked = torch.stack([captured[layer] for layer in capture_layers], dim=1).float().cpu()
        out_hidden = {key: stacked[i] for i, key in enumerate(capture_keys)}
    return StepOutput(out_logits, out_hidden, _row_stats(logits, logit_keys, stat_rows))


def _row_tables(item_tables: list[tuple[list[int], int]]) -> torch.Tensor:
    """A block table per row (each item's, repeated for its rows), padded to one width."""
    width = max(len(t) for t, _ in item_tables)
    rows = [row for t, n in item_tables for row in [t + [0] * (width - len(t))] * n]
    return torch.tensor(rows, dtype=torch.long)


def _row_stats(
    logits: torch.Tensor, keys: list[tuple[int, int]], rows: list[tuple[int, bool]]
) -> dict[tuple[int, int], RowStats]:
    """Max and argmax of the rows that sample greedily or report logprobs, and logsumexp of
    those reporting logprobs: one batched reduction per step instead of one per sequence."""
    if not rows:
        return {}
    every_row = len(rows) == len(keys)  # rows are in logit order: no gather needed
    scores = (logits if every_row else logits[torch.tensor([i for i, _ in rows])]).float()
    if scores.device.type == "cpu" and kernels.loaded():
        # one pass per row on this thread (kernels' row_stats: torch's reductions split a row
        # over the OpenMP threads, 76 us for SmolLM2's max alone on 2 threads, against ~15)
        want = torch.tensor([wants for _, wants in rows], dtype=torch.bool)
        maxima, argmaxes, lse = kernels.ops().row_stats(scores, want)
        stats = zip(rows, maxima.tolist(), argmaxes.tolist(), lse.tolist(), strict=True)
        return {keys[i]: RowStats(m, a, v if wants else None) for (i, wants), m, a, v in stats}
    maxima, argmaxes = scores.max(dim=-1)
    lp = [j for j, (_, wants) in enumerate(rows) if wants]
    lses: list[float | None] = [None] * len(rows)
    if lp:
        # logsumexp = max - log_softmax at the max. Not torch.logsumexp: it splits one row's
        # reduction over the OpenMP threads, and on a busy 2-core machine a descheduled thread
        # stalls that barrier for milliseconds (measured 0.08 -> 30 ms); log_softmax keeps a
        # row on one thread.
        if len(lp) < len(rows):
            sel = torch.tensor(lp)
            scores, maxima_lp, argmaxes_lp = scores[sel], maxima[sel], argmaxes[sel]
        else:
            maxima_lp, argmaxes_lp = maxima, argmaxes
        values = maxima_lp - torch.log_softmax(scores, dim=-1).gather(-1, argmaxes_lp[:, None])[:, 0]
        for j, v in zip(lp, values.tolist(), strict=True):
            lses[j] = v
    return {
        keys[i]: RowStats(m, a, lse)
        for (i, _), m, a, lse in zip(rows, maxima.tolist(), argmaxes.tolist(), lses, strict=True)
    }
