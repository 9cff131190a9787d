"""Per-position outputs of one request: prompt logprobs and readouts, and generated readouts.

A request owes an event for every prompt position its logprob or readout ranges cover, a
logprob for the generated positions it asked for, and a readout for every generated position
its readout ranges cover. `PositionOutputs` is the one place that knows which:

- admission asks where the request's own computation must start (`recompute_from`): the KV of
  earlier positions may be reused, but a position that owes a logprob needs the logits of the
  position before it and one that owes a readout needs its own hidden states;
- the scheduler asks which rows of a chunk the step keeps (`rows`), and the step keeps those;
- postprocess hands it the prompt logprobs as they arrive and takes back what a step completed
  (`prompt_done`, `generated_done`).

The ranges are kept merged and sorted, so each question costs O(log ranges + rows answered):
nothing walks the whole prompt at each step.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar


class Positioned(Protocol):
    """A generated token's event (request.py's TokenEvent): deferred by its position. A protocol,
    not an import: request.py imports this module."""

    @property
    def position(self) -> int: ...


E = TypeVar("E", bound=Positioned)

# a position's logprob and its top alternatives (None when not asked for)
Logprob = tuple[float, list[tuple[int, float]] | None]


class Spans:
    """A set of positions held as sorted, disjoint, non-touching half-open intervals."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]], lo: int = 0, hi: int | None = None) -> None:
        starts: list[int] = []
        ends: list[int] = []
        # as tuples: callers' ranges may be lists (decoded JSON), and lists and tuples do not sort together
        for start, end in sorted((start, end) for start, end in ranges):
            start, end = max(start, lo), end if hi is None else min(end, hi)
            if start >= end:
                continue
            if ends and start <= ends[-1]:  # overlaps or touches the previous one: merge
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self._starts = starts
        self._ends = ends

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __contains__(self, position: int) -> bool:
        i = bisect_right(self._starts, position) - 1
        return i >= 0 and position < self._ends[i]

    def first(self) -> int | None:
        return self._starts[0] if self._starts else None

    def end(self) -> int:
        """Past the last position (0 when empty)."""
        return self._ends[-1] if self._ends else 0

    def within(self, lo: int, hi: int) -> Iterator[int]:
        """The positions in [lo, hi), ascending."""
        i = bisect_right(self._ends, lo)  # the first interval that ends past lo
        while i < len(self._starts) and self._starts[i] < hi:
            yield from range(max(self._starts[i], lo), min(self._ends[i], hi))
            i += 1

    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us more, paid per request per step
class ChunkRows:
    """What a step keeps of one request's chunk [start, end), by absolute position. Read-only."""

    prompt_logprobs: list[int]  # rows q whose logits give prompt position q + 1 its logprob
    sample: int | None  # the row whose logits pick the next token (the chunk ends the sequence)
    logits: list[int]  # every row whose logits the step returns, ascending
    capture: list[int]  # rows whose hidden states the step returns (readouts), ascending


class PromptOutput(NamedTuple):
    """A prompt position whose event is due: its logprob (if it owes one) and whether it owes a
    readout (postprocess projects the step's hidden state of that position)."""

    position: int
    logprob: Logprob | None
    readout: bool


class PositionOutputs(Generic[E]):
    """Which positions of one request owe logprobs and readouts, and those results until their
    events are due. Mutated only under the engine lock (like its Request)."""

    def __init__(
        self,
        prompt_len: int,
        logprob_ranges: Iterable[tuple[int, int]] | None = None,
        logprobs: bool = False,
        readout_ranges: Iterable[tuple[int, int]] = (),
    ) -> None:
        """`logprob_ranges` None: every generated position gets a logprob when `logprobs` is
        set, and no prompt position does; given, exactly the positions it covers (prompt or
        generated) get one. `readout_ranges`: the positions that get readouts."""
        lp_ranges = list(logprob_ranges) if logprob_ranges is not None else None
        readout = Spans(readout_ranges)
        prompt_lp = lp_ranges or ()
        # logprobs of generated positions: every one, or the ranges' (unclipped: absolute)
        self._generated_lp: Spans | bool = logprobs if lp_ranges is None else Spans(lp_ranges)
        self._readout = readout
        # prompt positions that owe a logprob: position 0 has no logits before it (its event
        # still goes out, with no logprob, when the ranges cover it)
        self._prompt_lp = Spans(prompt_lp, 1, prompt_len)
        self._prompt_readout = Spans(readout.intervals(), 0, prompt_len)
        # prompt positions that owe an event at all
        self._prompt_owed = Spans([*prompt_lp, *readout.intervals()], 0, prompt_len)
        self._owed_end = self._prompt_owed.end()  # past the last of them: decode steps stop here
        self._emitted_to = 0  # prompt positions below this had their events
        self._prompt_logprobs: dict[int, Logprob] = {}  # arrived a chunk before their event
        # generated tokens' events waiting for their position's hidden state (computed in the
        # step after they were sampled), by position
        self._deferred: dict[int, E] = {}
        # (reason, detail) of a finish that waits for the deferred events to go out first
        self.finish_after_readouts: tuple[str, str | int | None] | None = None  # (reason, detail)
        first = prompt_len - 1
        owed, lp = self._prompt_owed.first(), self._prompt_lp.first()
        if owed is not None:
            first = min(first, owed)
        if lp is not None:
            first = min(first, lp - 1)
        # KV from here on is (re)computed by this request: its logits and hidden states are needed
        self.recompute_from = max(first, 0)

    # ---- the step's rows ------------------------------------------------------------------------

    def rows(self, start: int, end: int, length: int) -> ChunkRows:
        """The rows a step computing positions [start, end) of a sequence of `length` tokens keeps."""
        sample = end - 1 if end == length else None
        if max(start, self._emitted_to) >= self._owed_end and not self._deferred:
            # nothing owed from here on (every decode step of most requests): no window queries
            return ChunkRows([], sample, [] if sample is None else [sample], [])
        # a prompt position's logprob comes from the row before it, so the chunk's last row
        # serves the next chunk's first position
        prompt_lp = [p - 1 for p in self._prompt_lp.within(max(start + 1, self._emitted_to), end + 1)]
        logits = prompt_lp
        if sample is not None and (not prompt_lp or prompt_lp[-1] != sample):
            logits = [*prompt_lp, sample]
        capture = list(self._prompt_readout.within(max(start, self._emitted_to), end))
        if self._deferred:  # generated positions follow the prompt's: the order holds
            capture += sorted(p for p in self._deferred if start <= p < end)
        return ChunkRows(prompt_lp, sample, logits, capture)

    # ---- prompt positions -----------------------------------------------------------------------

    def store_prompt_logprob(self, position: int, logprob: Logprob) -> None:
        self._prompt_logprobs[position] = logprob

    def prompt_done(self, end: int) -> list[PromptOutput]:
        """The prompt positions below `end` (now computed) whose events are due, ascending; each
        is handed out once (a recomputation after preemption gives nothing again)."""
        if end <= self._emitted_to:
            return []
        start, self._emitted_to = self._emitted_to, end
        if start >= self._owed_end:
            return []
        return [
            PromptOutput(p, self._prompt_logprobs.pop(p, None), p in self._prompt_readout)
            for p in self._prompt_owed.within(start, end)
        ]

    # ---- generated positions --------------------------------------------------------------------

    def wants_logprob(self, position: int) -> bool:
        """Whether the token generated at `position` reports its logprob."""
        lp = self._generated_lp
        return lp if isinstance(lp, bool) else position in lp

    def wants_readout(self, position: int) -> bool:
        return position in self._readout

    def defer(self, event: E) -> None:
        """Hold a generated token's event until its position's hidden state is computed."""
        self._deferred[event.position] = event

    @property
    def waiting(self) -> bool:
        """Whether generated events are held for their readouts."""
        return bool(self._deferred)

    def generated_done(self, end: int) -> list[E]:
        """The held events of positions below `end` (now computed), ascending; their readouts
        are the caller's to fill in."""
        if not self._deferred:
            return []
        return [self._deferred.pop(p) for p in sorted(self._deferred) if p < end]
