"""After a model step: each request's events and whether it ended.

`postprocess` reads the step's outputs and advances each request's own state (its session's
tokens and computed KV, its decoder, constraint and counters); it never touches the engine.
It returns one Outcome per request: the events to deliver, in order, and the finish (if any),
which the engine loop applies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Set
from dataclasses import dataclass, field

import torch

from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.constraints import ConstraintError
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import BacktrackEvent, Event, FinishReason, Request, TokenEvent
from tokenwire.engine.sampler import logprobs_of, processed_logits, sample
from tokenwire.engine.step import RowStats, StepItem, StepOutput
from tokenwire.model.tokenizer import Tokenizer

log = logging.getLogger("tokenwire.engine")

NO_TOKEN_ALLOWED = "constraint allows no token at this position"


@dataclass(frozen=True)
class StepContext:
    """The fixed facts about the model that postprocessing needs."""

    kv: KVCache
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    eos_ids: Set[int]
    concepts: ConceptSet | None


@dataclass
class Finish:
    reason: FinishReason
    error: str | None = None
    detail: str | int | None = None  # the stop string or stop token id ("constraint": its stop)
    bad_input: bool = False  # the error is the request's own (FinishEvent.bad_input)


@dataclass
class Outcome:
    request: Request
    events: list[Event] = field(default_factory=list)
    finish: Finish | None = None
    guesses: tuple[int, int] | None = None  # (proposed, accepted) of a speculating step


def postprocess(items: list[StepItem], output: StepOutput, ctx: StepContext) -> list[Outcome]:
    outcomes = []
    for item in items:
        if item.request.finished:
            continue  # cancelled while the step ran; its KV is already released
        outcome = Outcome(item.request)
        try:
            _after_item(ctx, item, output, outcome)
        except ConstraintError as exc:  # the request's grammar failed (llguidance's own limits)
            outcome.finish = Finish("error", error=f"{type(exc).__name__}: {exc}", bad_input=True)
        except Exception as exc:  # one sequence's failure ends only that sequence
            log.exception("request %s failed after a step", item.request.id)
            outcome.finish = Finish("error", error=f"{type(exc).__name__}: {exc}")
        outcomes.append(outcome)
    return outcomes


def _readout(ctx: StepContext, hidden: torch.Tensor) -> torch.Tensor:
    assert ctx.concepts is not None
    return ctx.concepts.project(hidden[None])[0]


def _after_item(ctx: StepContext, item: StepItem, output: StepOutput, out: Outcome) -> None:
    request = item.request
    opts = request.options
    session = request.session
    rid = request.id
    end = item.start + item.count - len(item.draft)  # the guesses, if any, come after this
    session.computed(end, ctx.kv)
    positions = request.positions
    for q in item.rows.prompt_logprobs:
        logits = output.logits[(rid, q)]
        if opts.logprob_mode == "processed":
            logits = processed_logits(logits, opts.sampling, None, ctx.vocab_size)
        positions.store_prompt_logprob(q + 1, logprobs_of(logits, session.tokens[q + 1], opts.top_logprobs))
    for done in positions.prompt_done(end):
        p = done.position
        logprob, top = done.logprob or (None, None)
        readout = _readout(ctx, output.hidden[(rid, p)]) if done.readout else None
        out.events.append(TokenEvent(session.tokens[p], p, True, logprob, top, readout))
    _readouts_done(ctx, request, output, end, out)
    if end < len(session.tokens):
        return  # more of the prompt (or of forced tokens) still to compute
    if _finish_after_readouts(request, out):
        return
    if item.draft:
        _verify(ctx, item, output, out, end - 1)
    else:
        _next_token(ctx, request, output.logits[(rid, end - 1)], output.stats.get((rid, end - 1)), out)


def _readouts_done(ctx: StepContext, request: Request, output: StepOutput, end: int, out: Outcome) -> None:
    """The generated tokens' events held for their readouts, of positions now computed below `end`."""
    for event in request.positions.generated_done(end):
        event.readout = _readout(ctx, output.hidden[(request.id, event.position)])
        out.events.append(event)


def _finish_after_readouts(request: Request, out: Outcome) -> bool:
    """A finish held until the readouts before it went out (they have, once its token is computed)."""
    if request.positions.finish_after_readouts is None:
        return False
    reason, detail = request.positions.finish_after_readouts
    out.finish = Finish(reason, detail=detail)
    return True


def _verify(ctx: StepContext, item: StepItem, output: StepOutput, out: Outcome, row: int) -> None:
    """A step that ran guesses after the last token (engine/speculation.py), whose position is
    `row`: each row is sampled as a one-token step would sample it (the constraint asked, as
    ever); while the tokens appended, sampled or forced, are the guesses run after that row,
    their KV (computed in this step at their positions) is kept and the row after them is read.
    The first token that is not a guess ends it: it is appended like any token, and the KV of
    the rows after it is not marked computed (the next step overwrites it)."""
    request, session, rid = item.request, item.request.session, item.request.id
    draft, used = item.draft, 0
    while True:
        before = len(session.tokens)
        _next_token(ctx, request, output.logits[(rid, row)], output.stats.get((rid, row)), out)
        added = session.tokens[before:]  # empty after a backtrack
        kept = 0
        while kept < len(added) and used + kept < len(draft) and added[kept] == draft[used + kept]:
            kept += 1
        if kept:
            row, used = row + kept, used + kept
            session.computed(row + 1, ctx.kv)
            _readouts_done(ctx, request, output, row + 1, out)
        if out.finish is not None or kept == 0 or kept < len(added):
            break  # finished, backtracked, or a token that is not the guess
        if _finish_after_readouts(request, out):
            break  # the last token kept ends the request (its readout, if owed, went out)
    assert request.speculator is not None  # the scheduler guesses only for requests that have one
    request.speculator.verified(item.guessed, min(used, item.guessed))
    out.guesses = (len(draft), used)


def _next_token(
    ctx: StepContext,
    request: Request,
    logits: torch.Tensor,
    stats: RowStats | None,
    out: Outcome,
) -> None:
    opts = request.options
    session = request.session
    if _at_length(ctx, request):  # prefill only (max_tokens 0), or the prompt fills the context
        out.finish = Finish("length")
        return
    step = None
    constraint = opts.constraint
    if constraint is not None:
        step = constraint.next_step()
        if step.stop:
            out.finish = Finish("stop", detail="constraint")
            return
        if step.backtrack:
            count = min(step.backtrack, request.generated)
            session.truncate(len(session.tokens) - count, ctx.kv)
            request.generated -= count
            request.decoder = ctx.tokenizer.incremental_decoder(skip_special_tokens=not opts.special_text)
            constraint.on_backtrack(count)
            # recompute the new last token so its logits are available to sample from
            session.uncompute_from(len(session.tokens) - 1, ctx.kv)
            out.events.append(BacktrackEvent(count, len(session.tokens)))
            return
        if step.force:
            for token in step.force:
                if _append(ctx, request, token, None, None, out, forced=True):
                    return
                constraint.on_token(token)
            return  # the forced tokens are computed in the next step, then we ask again
    scores = processed_logits(logits, opts.sampling, step, ctx.vocab_size)
    # a mask (or a bias of -inf, AICI's form of a mask) may rule out every token: greedy sees
    # it as a -inf maximum (no extra pass), sampling checks the whole row first
    constrained = step is not None and (step.allowed is not None or step.bias is not None)
    greedy = opts.sampling.temperature == 0
    if constrained and not greedy and bool(torch.isinf(scores).all()):
        out.finish = Finish("error", error=NO_TOKEN_ALLOWED)
        return
    plain = scores is logits  # no bias, mask or padding rows: the step's row stats apply
    if plain and stats is not None and greedy:
        token = stats.argmax
    else:
        token = sample(scores, opts.sampling, request.generator)
        if constrained and greedy and scores[token] == float("-inf"):
            out.finish = Finish("error", error=NO_TOKEN_ALLOWED)
            return
    if _append(ctx, request, token, logits, scores, out, forced=False, stats=stats, plain=plain):
        return
    if constraint is not None:
        constraint.on_token(token)


def _append(
    ctx: StepContext,
    request: Request,
    token: int,
    raw: torch.Tensor | None,
    processed: torch.Tensor | None,
    out: Outcome,
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
    request.token_times.append(time.monotonic())
    logprob = top = None
    positions = request.positions
    if positions.wants_logprob(position):
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
    assert request.decoder is not None  # set at admission (prepare)
    text = request.decoder.feed(token)
    finish = _ends_generation(ctx, request, token, text)
    event = TokenEvent(token, position, False, logprob, top, None, text, forced)
    if finish is not None:
        event.finish_reason = finish.reason
    if positions.wants_readout(position):
        positions.defer(event)  # goes out once the next step computes its hidden state
    else:
        out.events.append(event)
    if finish is None:
        return False
    if positions.waiting:
        positions.finish_after_readouts = (finish.reason, finish.detail)
    else:
        out.finish = finish
    return True


def _ends_generation(ctx: StepContext, request: Request, token: int, text: str) -> Finish | None:
    """Whether the token just appended ends the request: the one end-of-generation rule."""
    opts = request.options
    if token in ctx.eos_ids and not opts.ignore_eos:
        return Finish("eos", detail=token)
    if token in opts.stop_token_ids:
        return Finish("stop", detail=token)
    if request.stopper is not None and text and request.stopper.feed(text) is not None:
        return Finish("stop", detail=request.stopper.matched)
    if _at_length(ctx, request):
        return Finish("length")
    return None


def _at_length(ctx: StepContext, request: Request) -> bool:
    return request.generated >= request.options.max_tokens or len(request.session.tokens) >= ctx.max_model_len
