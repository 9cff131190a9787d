"""Draft-model speculation (`--draft-model PATH`): guesses from a smaller model with the same
vocabulary, run greedily ahead of the request.

The draft runs on an engine of its own (its weights, its paged KV cache, its model thread), one
session per guessing request holding what the request's context was at the last guess plus
the guesses. Each guess syncs that session to the request's tokens (the draft keeps the longest
common prefix and computes only what is new), then decodes the guesses greedily. Verification
is the target's, as for prompt lookup (engine/speculation.py): the guesses are point-mass
drafts, so greedy output and logprobs are the same with and without them, and sampling keeps the
target's distribution. How many to guess adapts as for prompt lookup: while a first guess is
seldom kept, one now and then.

The target's model thread waits while the draft runs: the two never compete for the cores. It
waits outside the engine lock, and for all requests' guesses at once: the calls are planned under
the lock before schedule(), run as one batch in the draft engine with the lock released, and the
scheduler's propose() takes what came back (DraftSpeculator, run_drafts).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import EngineHandle, GenerateOptions, SamplingParams, TokenEvent
from tokenwire.engine.session import common_prefix
from tokenwire.engine.speculation import MAX_GUESSES, Speculator

if TYPE_CHECKING:
    from tokenwire.engine.scheduler import Scheduler
    from tokenwire.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the guesses need of the draft model's engine (engine.Engine, described here so that
    the module the engine imports need not import it back)."""

    max_model_len: int

    def create_session(self, tokens: Sequence[int] = (), ttl_s: Any = ...) -> str: ...

    def truncate_session(self, session_id: str, length: int) -> None: ...

    def close_session(self, session_id: str) -> bool: ...

    def generate(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
    ) -> EngineHandle: ...

    def holding(self) -> threading.RLock: ...


_GREEDY = SamplingParams(temperature=0.0)


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """A draft's guesses are token ids of the target's: both vocabularies must be one. Refused at
    start, naming the first id that differs."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"--draft-model {draft_name} has a vocabulary of {draft.vocab_size} tokens, the model "
            f"{target.vocab_size}: a draft must share the model's tokenizer"
        )
    for token in range(target.vocab_size):
        if target.token_bytes(token) != draft.token_bytes(token):
            raise ValueError(
                f"--draft-model {draft_name}'s token {token} is {draft.token_bytes(token)!r}, the "
                f"model's {target.token_bytes(token)!r}: a draft must share the model's tokenizer"
            )


@dataclass
class DraftCall:
    """One request's guesses to make this step: `count` tokens after `tokens` (a copy)."""

    speculator: DraftSpeculator
    tokens: list[int]
    count: int
    handle: EngineHandle | None = None  # the draft engine's request, once submitted


class DraftSpeculator(Speculator):
    """One request's guesses from the draft engine (a session there, closed with the request).

    The guesses are made in three moves around the engine lock (engine.py's step loop):
    plan (lock held: whether to guess and how many), run_drafts (lock released: every request's
    draft call submitted, then all awaited) and settle (lock held again); the scheduler's
    propose() then only hands over what the draft gave. While a call is out, the model thread
    alone touches the draft session; close() meanwhile leaves it to settle."""

    def __init__(self, draft: Engine) -> None:
        super().__init__()
        self.draft = draft
        self._session: str | None = None
        self._held: list[int] = []  # the draft session's tokens
        self._ready: tuple[list[int], list[int]] | None = None  # (context, its guesses) for propose
        self._out = False  # a draft call is planned or running (engine lock released)
        self._closed = False

    def plan(self, tokens: list[int], limit: int, threshold: float) -> DraftCall | None:
        """Engine lock held: the guesses to make after `tokens`, at most `limit` (None: none)."""
        if self._closed or self._out or (self._ready is not None and self._ready[0] == tokens):
            return None  # ended, or the last guesses still wait for the request's turn
        count = self.to_guess(limit, threshold)
        if count == 0 or len(tokens) + count > self.draft.max_model_len:
            return None  # no guess this step, or past the draft's context
        self._out = True
        return DraftCall(self, list(tokens), count)

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        """The scheduler's call, engine lock held: the draft's guesses for exactly this context,
        at most `limit`. Nothing here runs the draft (it would hold the lock for a draft step);
        a context with no guesses made for it gets none this step."""
        ready, self._ready = self._ready, None
        if ready is None or ready[0] != tokens:
            return []
        return ready[1][:limit]

    def close(self) -> None:
        self._closed = True
        if not self._out:  # else the model thread's draft call is out: settle() closes it
            self._end_session()

    def _submit(self, call: DraftCall) -> None:
        """Engine lock released: start the draft's greedy decode after call.tokens."""
        # the last token is fed again whatever is kept: its logits give the first guess
        common = min(common_prefix(self._held, call.tokens), len(call.tokens) - 1)
        opts = GenerateOptions(max_tokens=call.count, sampling=_GREEDY, ignore_eos=True, speculate=False)
        try:
            if self._session is None:
                self._session = self.draft.create_session(ttl_s=None)
            self.draft.truncate_session(self._session, common)
            call.handle = self.draft.generate(self._session, call.tokens[common:], opts)
        except EngineError as e:  # guesses are optional: a draft shutting down or full gives none
            log.debug("no draft guesses: %s", e)
            self._held = []

    def _collect(self, call: DraftCall) -> None:
        """Engine lock released: wait for the guesses of a submitted call."""
        if call.handle is None:
            return
        events, _ = call.handle.result()
        guesses = [e.token_id for e in events if isinstance(e, TokenEvent) and not e.is_prefill]
        self._held = [*call.tokens, *guesses]
        self._ready = (call.tokens, guesses)

    def _settle(self) -> None:
        """Engine lock held again: the call is over; a request that ended meanwhile closes now."""
        self._out = False
        if self._closed:
            self._end_session()

    def _end_session(self) -> None:
        if self._session is not None:
            self.draft.close_session(self._session)
            self._session = None


def plan_drafts(scheduler: Scheduler) -> list[DraftCall]:
    """Engine lock held, before schedule(): the draft calls of this step, for every request
    schedule() will consider (the running ones and the waiting ones it will admit). A request
    whose chunk does not end its context this step (a long prompt) keeps its guesses until its
    context's turn: propose() checks the context."""
    room = max(0, scheduler.max_running - len(scheduler.running))
    # schedule() admits the waiting ones by (priority, arrival) while there is room
    admitted = sorted(scheduler.waiting, key=lambda r: (r.options.priority, r.id))[:room]
    live = [r for r in [*scheduler.running, *admitted] if not r.finished]
    # the scheduler's threshold: what a guess's row costs beside the step's decode rows
    decodes = scheduler.decode_shape(live)
    calls: list[DraftCall] = []
    for request in live:
        speculator = request.speculator
        if not isinstance(speculator, DraftSpeculator) or request.positions.finish_after_readouts is not None:
            continue  # as Scheduler._guesses: its last token ends it once its readout is out
        length = len(request.session.tokens)
        limit = request.options.max_tokens - request.generated - 1
        if scheduler.max_model_len is not None:
            limit = min(limit, scheduler.max_model_len - length - 1)
        if limit <= 0:
            continue
        # the step's room for guesses is known only in _pack: propose() cuts to it
        threshold = scheduler.step_cost.guess_share(decodes, length)  # its attention at `length` included
        call = speculator.plan(request.session.tokens, min(limit, MAX_GUESSES), threshold)
        if call is not None:
            calls.append(call)
    return calls


def run_drafts(draft: Engine, calls: list[DraftCall]) -> None:
    """Engine lock released: every call submitted before any is awaited, and submitted under
    the draft engine's lock, so its model thread schedules them all in one step: a draft step
    per guessed token for the whole batch, not one per request."""
    if not calls:
        return
    try:
        with draft.holding():
            for call in calls:
                call.speculator._submit(call)
        for call in calls:
            call.speculator._collect(call)
    except Exception:  # a failure costs guesses, never the step (settle_drafts still ends the calls)
        log.exception("draft guesses failed")


def settle_drafts(calls: list[DraftCall]) -> None:
    """Engine lock held again: the calls are over (their sessions closed where a request ended)."""
    for call in calls:
        call.speculator._settle()
