"""One model step: which tokens of which requests run, and the tensors that describe them.

run_step is three parts: gather_inputs (the items' rows as plain lists: ids, positions, KV
slots, block tables, the rows whose logits and hidden states come back), choose_attention (the
fused stack's PagedDecode or PagedAttention's groups) and run_model (forward, logits, row
stats). The model is seen through StepModel (engine/step_model.py), nothing else of it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from tokenwire.engine.attention import AttentionGroup, PagedAttention, build_group
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.positions import ChunkRows
from tokenwire.engine.request import Request
from tokenwire.engine.step_model import StepModel
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


Key = tuple[int, int]  # (request id, position): where a row's logits, hidden states, stats go


@dataclass
class ItemBlocks:
    """One item's rows of the packed batch and the KV blocks its positions reach."""

    rows: list[int]  # one per position start, start + 1, ...
    start: int
    blocks: list[int]  # in the full-context pool
    window_blocks: list[int]  # in the window pool (kv.window_pool), where the cache has one


@dataclass
class StepInputs:
    """A step's rows in packed order, as plain lists: what the model reads, where each row's
    K/V goes, and which rows come back (logits, row stats, captured hidden states)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each row's KV slot in the full-context pool
    window_slots: list[int] = field(default_factory=list)  # the same positions in the window pool
    items: list[ItemBlocks] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    logit_keys: list[Key] = field(default_factory=list)
    stat_rows: list[tuple[int, bool]] = field(default_factory=list)  # (index into logit rows, wants logprobs)
    capture_rows: list[int] = field(default_factory=list)
    capture_keys: list[Key] = field(default_factory=list)


def run_step(
    model: StepModel,
    kv: KVCache,
    items: list[StepItem],
    capture_layers: tuple[int, ...],
    vision: EmbeddingCache | None = None,
    team: StepTeam | None = None,
) -> StepOutput:
    """Gather the items' rows, choose the attention that reads the paged KV, run the model."""
    step = gather_inputs(items, kv.block_size)
    positions = torch.tensor(step.positions, device=kv.k.device)  # the model's and PagedDecode's
    attention = choose_attention(model, kv, step, positions)
    # vision models: M-RoPE positions and the image embeddings of pad rows (engine/vision.py)
    extra = {}
    if vision is not None:
        extra = step_inputs(model, vision, [(i.request.session, i.start, i.count) for i in items])
    return run_model(model, step, attention, positions, capture_layers, extra, team)


def gather_inputs(items: list[StepItem], block_size: int) -> StepInputs:
    """The step's token ids, positions, KV slots and block tables, and the rows it returns."""
    bs = block_size
    step = StepInputs()
    for item in items:
        session = item.request.session
        base = len(step.ids)
        table, window_table = session.block_table, session.window_table
        known = len(session.tokens)
        for p in range(item.start, item.start + item.count):
            step.ids.append(session.tokens[p] if p < known else item.draft[p - known])
            step.positions.append(p)
            step.slots.append(table[p // bs] * bs + p % bs)
            if window_table:
                step.window_slots.append(window_table[p // bs] * bs + p % bs)
        n_blocks = -(-(item.start + item.count) // bs)
        # blocks the window has left read block 0: the window's mask hides their positions
        window_blocks = [max(b, 0) for b in window_table[:n_blocks]]
        rows = list(range(base, base + item.count))
        step.items.append(ItemBlocks(rows, item.start, table[:n_blocks], window_blocks))
        _returned_rows(step, item, base)
    return step


def _returned_rows(step: StepInputs, item: StepItem, base: int) -> None:
    """The item's rows whose logits (and row stats) and hidden states come back."""
    rid = item.request.id
    opts = item.request.options
    for p in item.rows.logits:
        sampled = p == item.rows.sample or bool(item.draft)  # a draft's every row is sampled
        if sampled and (opts.sampling.temperature == 0 or opts.logprobs):
            step.stat_rows.append((len(step.logit_rows), opts.logprobs))
        step.logit_rows.append(base + p - item.start)
        step.logit_keys.append((rid, p))
    for p in item.rows.capture:
        step.capture_rows.append(base + p - item.start)
        step.capture_keys.append((rid, p))


def choose_attention(
    model: StepModel, kv: KVCache, step: StepInputs, positions: torch.Tensor
) -> PagedDecode | PagedAttention:
    """The fused stack's PagedDecode where the model fuses, else PagedAttention's groups."""
    if model.can_fuse_decode:
        return _fused_attention(kv, step, positions)
    return _grouped_attention(model, kv, step)


def _fused_attention(kv: KVCache, step: StepInputs, positions: torch.Tensor) -> PagedDecode:
    """Every step, decode rows and prefill chunks alike, runs the stack as one fused kernel
    that reads the block tables itself (a row per token: its position, its sequence's table).
    One kernel for every step is what keeps a token's arithmetic the same whether it was
    decoded, prefilled in one chunk or several, alone or in a batch."""
    tables = _row_tables([(b.blocks, len(b.rows)) for b in step.items])
    window = None
    if kv.window_pool is not None:
        pool = kv.window_pool
        window_tables = _row_tables([(b.window_blocks, len(b.rows)) for b in step.items])
        window = WindowPool(pool.k, pool.v, pool.k_scale, pool.v_scale, window_tables, kv.layer_slots)
    return PagedDecode(kv.k, kv.v, positions, tables, kv.k_scale, kv.v_scale, window)


def _grouped_attention(model: StepModel, kv: KVCache, step: StepInputs) -> PagedAttention:
    """A group per prefill chunk and one for all decode rows (engine/attention.py), for each
    pool the cache has."""
    device, dtype, bs = kv.k.device, model.dtype, kv.block_size
    rep = model.config.num_heads // model.config.num_kv_heads
    chunks = [b for b in step.items if len(b.rows) > 1]
    decodes = [b for b in step.items if len(b.rows) == 1]

    def groups_of(window: bool) -> list[AttentionGroup]:
        def table(b: ItemBlocks) -> list[int]:
            return b.window_blocks if window else b.blocks

        groups = [build_group([c.rows], [c.start], [table(c)], bs, rep, device, dtype) for c in chunks]
        if decodes:
            rows, starts = [d.rows for d in decodes], [d.start for d in decodes]
            groups.append(build_group(rows, starts, [table(d) for d in decodes], bs, rep, device, dtype))
        return groups

    windowed = None
    if kv.window_pool is not None:
        windowed = (torch.tensor(step.window_slots, device=device), groups_of(window=True))
    return PagedAttention(kv, torch.tensor(step.slots, device=device), groups_of(window=False), windowed)


def run_model(
    model: StepModel,
    step: StepInputs,
    attention: PagedDecode | PagedAttention,
    positions: torch.Tensor,
    capture_layers: tuple[int, ...],
    extra: dict[str, torch.Tensor],
    team: StepTeam | None,
) -> StepOutput:
    """The forward pass, the kept rows' logits, and their row stats."""
    device = positions.device
    capture = step.capture_rows
    capture_index = torch.tensor(capture, dtype=torch.long, device=device) if capture else None
    # the fused stack sizes its own team (kernels/barrier.h); other steps ask `team`
    fused = isinstance(attention, PagedDecode)
    sized = team.step(len(step.ids)) if team is not None and not fused else nullcontext()
    with torch.inference_mode(), sized:
        ids = torch.tensor(step.ids, device=device)
        hidden, captured = model(
            ids, positions, attention, capture_layers if capture else (), capture_index, **extra
        )
        if step.logit_rows == list(range(len(step.ids))):  # decode steps: every row, in order
            rows = hidden
        else:
            rows = hidden[torch.tensor(step.logit_rows, dtype=torch.long, device=device)]
        logits = model.logits(rows).cpu()
    out_logits = {key: logits[i] for i, key in enumerate(step.logit_keys)}
    out_hidden: dict[Key, torch.Tensor] = {}
    if capture:
        stacked = torch.stack([captured[layer] for layer in capture_layers], dim=1).float().cpu()
        out_hidden = {key: stacked[i] for i, key in enumerate(step.capture_keys)}
    return StepOutput(out_logits, out_hidden, _row_stats(logits, step.logit_keys, step.stat_rows))


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
