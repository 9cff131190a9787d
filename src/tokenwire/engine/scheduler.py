"""Continuous batching: which requests run in the next step, within a token budget.

Each step packs, priority by priority, the next token of every decoding request, then chunks
of pending prefills, until `max_batch_tokens`. Within a priority, the prompts being read share
what the decode rows leave of the step evenly (water-filling: a short prompt takes what it
needs, the rest is split among the long ones): a 4,000-token prompt read in arrival order took
whole steps for eight steps while a 2-token chat that came after it waited behind every one
(issue 41 measured 100 s on a 1.5B model); now the chat's prompt is read in the next step.
`prefill_share="arrival"` keeps the old order (the fairness bench's baseline). Requests are
ordered by (priority, arrival), so
interactive requests (priority 0) are admitted and served before batch ones (10). When the KV
budget is short, idle sessions give their blocks back first (their full blocks stay in the
prefix cache), then lower-priority requests are preempted: their KV is released and
recomputed later (usually from the prefix cache).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.positions import ChunkRows
from tokenwire.engine.request import Request
from tokenwire.engine.session import Session
from tokenwire.engine.speculation import StepCost, StepShape
from tokenwire.engine.step import StepItem

FailFn = Callable[[Request, str], None]  # ends a request with finish reason "error"


def _order(request: Request) -> tuple[int, int]:
    return (request.options.priority, request.id)


def _pack_order(request: Request) -> tuple[int, bool, int]:
    prefilling = len(request.session.tokens) - request.session.num_computed > 1
    return (request.options.priority, prefilling, request.id)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_batch_tokens: int,
        max_running: int,
        idle_sessions: Callable[[], list[Session]],
        max_model_len: int | None = None,
        step_cost: StepCost | None = None,
        prefill_share: str = "fair",
    ) -> None:
        if prefill_share not in ("fair", "arrival"):
            raise ValueError(f"prefill_share is 'fair' or 'arrival', got {prefill_share!r}")
        self.prefill_share = prefill_share
        self.kv = kv
        self.max_model_len = max_model_len  # guesses stop short of it
        self.step_cost = step_cost or StepCost()  # what a guess's row costs (engine/speculation.py)
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.idle_sessions = idle_sessions
        self.spill: Callable[[Session], object] | None = None  # writes an idle session's KV to disk
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, fail: FailFn) -> list[StepItem]:
        self.waiting.sort(key=_order)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        self.running.sort(key=_order)
        items = self._pack()
        if not items and self.running:
            # Nothing fits: give the most urgent request the whole cache, or fail it.
            top = self.running[0]
            for other in self.running[1:]:
                self._preempt(other)
            items = self._pack()
            if not items and not top.finished:
                fail(
                    top,
                    "KV cache budget exhausted: the sequence needs more blocks than the budget holds "
                    f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens, --kv-cache-mb)",
                )
        return items

    def _pack(self) -> list[StepItem]:
        budget = self.max_batch_tokens
        items: list[StepItem] = []
        # the step's decode rows: what a guess's row costs beside them (engine/speculation.py)
        decodes = self.decode_shape(self.running)
        scheduled: set[int] = set()
        for request in self.running:
            session = request.session
            if not request.started:
                request.started = True
                if request.options.use_prefix_cache:
                    session.match_prefix(
                        min(request.positions.recompute_from, len(session.tokens) - 1), self.kv
                    )
                if request.cached_tokens is None:
                    request.cached_tokens = session.num_computed
                    request.disk_tokens = session.from_disk
        # most urgent first, so a request only ever preempts less urgent ones that have not
        # been scheduled in this step; within a priority, decodes before prefills
        order = sorted((r for r in self.running if not r.finished), key=_pack_order)
        for i, request in enumerate(order):
            if budget <= 0:
                break
            session = request.session
            start = session.num_computed
            length = len(session.tokens)
            count = min(length - start, budget)
            if count > 1 and self.prefill_share == "fair":
                count = _fair_share(order[i:], request, budget)
            if count <= 0:
                continue
            end = start + count
            # the request's positions say which rows of the chunk the step keeps
            rows = request.positions.rows(start, end, length)
            draft, guessed = self._guesses(request, budget - count, decodes) if end == length else ([], 0)
            if not self._make_room(session.blocks_needed(end + len(draft), self.kv), request, scheduled):
                continue
            session.reserve(end + len(draft), self.kv)
            if draft:  # every row from the last token on: postprocess verifies the guesses in order
                rows = _with_guesses(request, rows, end, len(draft))
            items.append(StepItem(request, start, count + len(draft), rows, draft, guessed))
            scheduled.add(request.id)
            budget -= count + len(draft)
        return items

    @staticmethod
    def decode_shape(requests: list[Request]) -> StepShape:
        """The step's decode rows (requests with one token to compute) and their contexts."""
        return StepShape.decodes(
            [len(r.session.tokens) for r in requests if len(r.session.tokens) - r.session.num_computed == 1]
        )

    def _guesses(self, request: Request, room: int, decodes: StepShape) -> tuple[list[int], int]:
        """Guesses of the tokens after a chunk that ends the request's context (a decode step,
        the prompt's last chunk, a forced span; engine/speculation.py), at most `room`: the
        speculator's, cut where the request's constraint would refuse them and followed by what
        it would force after them. Also how many of them are the speculator's own."""
        speculator = request.speculator
        if speculator is None or request.positions.finish_after_readouts is not None:
            return [], 0  # no speculation, or its last token ends it once its readout is out
        length = len(request.session.tokens)
        limit = min(room, request.options.max_tokens - request.generated - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - length - 1)
        if limit <= 0:
            return [], 0
        # the chance a guess must have of being kept to pay for its row, its attention over
        # the request's context included
        threshold = self.step_cost.guess_share(decodes, length)
        guesses = speculator.propose(request.session.tokens, limit, threshold)
        constraint = request.options.constraint
        if constraint is None:
            return guesses, len(guesses)
        allowed, forced = constraint.speculation(guesses, limit)
        return guesses[:allowed] + forced, allowed

    def _make_room(self, needed: tuple[int, int], request: Request, scheduled: set[int]) -> bool:
        """Free blocks until `needed` (full-context pool, window pool) are available: idle
        sessions first, then less urgent requests not in this step."""
        kv = self.kv
        if kv.has_room(needed):
            return True
        for session in self.idle_sessions():
            if self.spill is not None:  # its KV to disk first (engine/persistence.py)
                self.spill(session)
            session.release(kv)
            if kv.has_room(needed):
                return True
        victims = [
            v
            for v in sorted(self.running, key=_order, reverse=True)
            if _order(v) > _order(request) and v.id not in scheduled and v.session.block_table
        ]
        held = [v.session.blocks_held(kv) for v in victims]
        if not kv.has_room(needed, [sum(h[0] for h in held), sum(h[1] for h in held)]):
            return False  # preempting them all would not be enough: leave them running
        for victim in victims:
            self._preempt(victim)
            if kv.has_room(needed):
                return True
        return kv.has_room(needed)

    def _preempt(self, request: Request) -> None:
        if request.session.block_table:
            request.session.release(self.kv)
            request.started = False


def _fair_share(rest: list[Request], request: Request, budget: int) -> int:
    """The tokens of `budget` this prompt gets (it is rest[0]) when the prompts being read at
    its priority share what is left evenly: each takes min(what it needs, an equal share of
    what the shorter ones left). Recomputed per request as the budget shrinks, so a request
    that could not be placed (no KV room) leaves its share to the ones after it."""
    priority = request.options.priority
    needs = sorted(
        len(r.session.tokens) - r.session.num_computed
        for r in rest
        if r.options.priority == priority and len(r.session.tokens) - r.session.num_computed > 1
    )
    own = len(request.session.tokens) - request.session.num_computed
    left, sharing = budget, len(needs)
    for need in needs:
        share = left // sharing
        if need > share:
            return min(own, max(1, share))  # from here on every prompt gets the same share
        if need == own:
            return own
        left -= need
        sharing -= 1
    return min(own, left)


def _with_guesses(request: Request, rows: ChunkRows, end: int, guesses: int) -> ChunkRows:
    """A chunk's rows with guesses after it: every row's logits from its last token on (each
    verifies the next guess), and the hidden states of guessed positions that owe readouts."""
    verify = list(range(end - 1, end + guesses))
    logits = [*(p for p in rows.logits if p < end - 1), *verify]
    capture = [*rows.capture, *(p for p in range(end, end + guesses) if request.positions.wants_readout(p))]
    return ChunkRows(rows.prompt_logprobs, rows.sample, logits, capture)
