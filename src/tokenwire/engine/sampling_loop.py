"""After a model step: emit prompt events, then sample (or force) each finished sequence's next token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenwire.engine.request import BacktrackEvent, Request, TokenEvent, covers
from tokenwire.engine.sampler import logprobs_of, processed_logits, sample
from tokenwire.engine.step import RowStats, StepItem, StepOutput

NO_TOKEN_ALLOWED = "constraint allows no token at this position"

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine


def after_step(engine: Engine, items: list[StepItem], output: StepOutput) -> None:
    for item in items:
        request = item.request
        if request.finished:
            continue  # cancelled while the step ran; its KV is already released
        try:
            _after_item(engine, item, output)
        except Exception as exc:  # one sequence's failure (constraint, ...) ends only that sequence
            engine._finish(request, "error", error=f"{type(exc).__name__}: {exc}")


def _readout(engine: Engine, hidden: torch.Tensor) -> torch.Tensor:
    assert engine.concepts is not None
    return engine.concepts.project(hidden[None])[0]


def _after_item(engine: Engine, item: StepItem, output: StepOutput) -> None:
    request = item.request
    opts = request.options
    session = request.session
    rid = request.id
    end = item.start + item.count
    session.computed(end, engine.kv)
    lp_ranges = opts.logprob_ranges or ()
    for q in item.logit_positions:
        p = q + 1
        if p < request.prompt_len and p in request.pending_set and covers(lp_ranges, p):
            logits = output.logits[(rid, q)]
            if opts.logprob_mode == "processed":
                logits = processed_logits(logits, opts.sampling, None, engine.vocab_size)
            request.prompt_logprob[p] = logprobs_of(logits, session.tokens[p], opts.top_logprobs)
    while request.pending_prompt and request.pending_prompt[0] < end:
        p = request.pending_prompt.pop(0)
        request.pending_set.discard(p)
        logprob, top = request.prompt_logprob.pop(p, (None, None))
        readout = None
        if covers(opts.readout_ranges, p):
            readout = _readout(engine, output.hidden[(rid, p)])
        request.emit(TokenEvent(session.tokens[p], p, True, logprob, top, readout))
    for p in sorted(request.pending_readout):
        if p < end:
            event = request.pending_readout.pop(p)
            event.readout = _readout(engine, output.hidden[(rid, p)])
            request.emit(event)
    if end < len(session.tokens):
        return  # more of the prompt (or of forced tokens) still to compute
    if request.finish_after_compute is not None:
        reason, detail = request.finish_after_compute
        engine._finish(request, reason, detail=detail)
        return
    _next_token(engine, request, output.logits[(rid, end - 1)], output.stats.get((rid, end - 1)))


def _next_token(engine: Engine, request: Request, logits: torch.Tensor, stats: RowStats | None) -> None:
    opts = request.options
    session = request.session
    if request.generated >= opts.max_tokens or len(session.tokens) >= engine.max_model_len:
        engine._finish(request, "length")
        return
    step = None
    constraint = opts.constraint
    if constraint is not None:
        step = constraint.next_step()
        if step.stop:
            engine._finish(request, "stop", detail="constraint")
            return
        if step.backtrack:
            count = min(step.backtrack, request.generated)
            session.truncate(len(session.tokens) - count, engine.kv)
            request.generated -= count
            request.decoder = engine.tokenizer.incremental_decoder()
            constraint.on_backtrack(count)
            # recompute the new last token so its logits are available to sample from
            session.uncompute_from(len(session.tokens) - 1, engine.kv)
            request.emit(BacktrackEvent(count, len(session.tokens)))
            return
        if step.force:
            for token in step.force:
                if _append(engine, request, token, None, None, forced=True):
                    return
                constraint.on_token(token)
            return  # the forced tokens are computed in the next step, then we ask again
    scores = processed_logits(logits, opts.sampling, step, engine.vocab_size)
    # a mask (or a bias of -inf, AICI's form of a mask) may rule out every token: greedy sees
    # it as a -inf maximum (no extra pass), sampling checks the whole row first
    constrained = step is not None and (step.allowed is not None or step.bias is not None)
    greedy = opts.sampling.temperature == 0
    if constrained and not greedy and bool(torch.isinf(scores).all()):
        engine._finish(request, "error", error=NO_TOKEN_ALLOWED)
        return
    plain = scores is logits  # no bias, mask or padding rows: the step's row stats apply
    if plain and stats is not None and opts.sampling.temperature == 0:
        token = stats.argmax
    else:
        token = sample(scores, opts.sampling, request.generator)
        if constrained and greedy and scores[token] == float("-inf"):
            engine._finish(request, "error", error=NO_TOKEN_ALLOWED)
            return
    if _append(engine, request, token, logits, scores, forced=False, stats=stats, plain=plain):
        return
    if constraint is not None:
        constraint.on_token(token)


def _append(
    engine: Engine,
    request: Request,
    token: int,
    raw: torch.Tensor | None,
    processed: torch.Tensor | None,
    *,
    forced: bool,
    stats: RowStats | None = None,
    plain: bool = False,
) -> bool:
    """Append one generated token; returns True when the request finished."""
    opts = request.options
    session = request.session
    position = len(session.tokens)
    session.tokens.append(token)
    request.generated += 1
    logprob = top = None
    wants_lp = opts.logprobs if opts.logprob_ranges is None else covers(opts.logprob_ranges, position)
    if wants_lp:
        source = processed if opts.logprob_mode == "processed" else raw
        if (
            stats is not None
            and stats.logsumexp is not None
            and raw is not None
            and (plain or source is raw)
            and opts.top_logprobs <= 1
        ):
            # the step's reduction of the raw row: no second pass over the vocabulary
            top_value = stats.max_logit if token == stats.argmax else float(raw[token])
            logprob = top_value - stats.logsumexp
            top = [(stats.argmax, stats.max_logit - stats.logsumexp)] if opts.top_logprobs else None
        elif source is not None:
            logprob, top = logprobs_of(source, token, opts.top_logprobs)
        else:
            logprob, top = 0.0, [(token, 0.0)] if opts.top_logprobs else None  # forced: certain
    text = request.decoder.feed(token)
    event = TokenEvent(token, position, False, logprob, top, None, text, forced)
    if covers(opts.readout_ranges, position):
        request.pending_readout[position] = event
    else:
        request.emit(event)
    reason: str | None = None
    detail: Any = None
    if token in engine.eos_ids and not opts.ignore_eos:
        reason, detail = "eos", token
    elif token in opts.stop_token_ids:
        reason, detail = "stop", token
    elif request.stopper is not None and text and request.stopper.feed(text) is not None:
        reason, detail = "stop", request.stopper.matched
    elif request.generated >= opts.max_tokens or len(session.tokens) >= engine.max_model_len:
        reason = "length"
    if reason is None:
        return False
    if request.pending_readout:
        request.finish_after_compute = (reason, detail)
    else:
        engine._finish(request, reason, detail=detail)
    return True
