"""What a caller asks of the engine (GenerateOptions) and what it gets back (events)."""

from __future__ import annotations

import math
import queue
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import torch

from tokenwire.engine.constraints import Constraint
from tokenwire.engine.errors import InvalidRequestError
from tokenwire.engine.events import EventChannel, EventFeed
from tokenwire.engine.positions import PositionOutputs
from tokenwire.engine.session import Session
from tokenwire.engine.speculation import Speculator

if TYPE_CHECKING:  # types only: set by admission.prepare, which imports them itself
    from tokenwire.engine.stop import StopStringMatcher
    from tokenwire.model.tokenizer import IncrementalDecoder

Ranges = Sequence[tuple[int, int]]  # half-open [start, end) absolute positions

# eos: the model's end token; length: max_tokens or the context's end; stop: a stop token id,
# stop string or a constraint's stop; cancelled: the caller (or shutdown) ended it; error: failed
FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]


# ------------------------------------------------------------------ the numeric rules
# Every protocol's numbers meet these, through SamplingParams/GenerateOptions.validate or the
# require_* helpers below; a protocol only turns the InvalidValueError into its own error form.
SEED_LIMIT = 2**64  # seeds are 0 <= seed < 2**64: a torch generator's whole range


class InvalidValueError(InvalidRequestError):
    """A request value of the wrong type (a bool for an integer, NaN or infinity for a number)
    or out of range; `field` names it (in the protocol's words where it passed its names)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def shown(value: object) -> str:
    """A value short enough for an error message: a 5,000-digit integer is not echoed back (nor
    can it be: Python refuses str() of an int over 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def require_int(
    value: object, field: str, lo: int | None = None, hi: int | None = None, *, what: str | None = None
) -> int:
    """`value` as an integer in [lo, hi] (either bound optional); never a bool (JSON's `true` is
    no token id or length 1). `what` names a part of `field` (an item, a key) in the message."""
    what = what or field
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidValueError(field, f"{what} must be an integer, got {shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in {lo}..{hi}"
        raise InvalidValueError(field, f"{what} must be {bounds}, got {shown(value)}")
    return value


def require_number(
    value: object, field: str, lo: float | None = None, hi: float | None = None, *, what: str | None = None
) -> float:
    """`value` as a finite number in [lo, hi] (either bound optional): never a bool, NaN or an
    infinity (each passes or breaks a comparison in ways no range check expects)."""
    what = what or field
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidValueError(field, f"{what} must be a number, got {shown(value)}")
    try:
        number = float(value)  # an integer past 1.8e308 overflows: no finite number either
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidValueError(field, f"{what} must be a finite number, got {shown(value)}")
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise InvalidValueError(field, f"{what} must be {bounds}, got {shown(value)}")
    return number


def require_seed(value: object, field: str = "seed") -> int:
    """A sampling seed: an integer, 0 <= seed < 2**64."""
    seed = require_int(value, field)
    if not 0 <= seed < SEED_LIMIT:
        raise InvalidValueError(field, f"{field} must be in 0..2**64-1, got {shown(seed)}")
    return seed


def choice_seed(seed: int | None, choice: int, field: str = "seed") -> int | None:
    """The seed of choice `choice` (0, 1, ...) of a request for several from one seed: seed +
    choice modulo 2**64 (seed 2**64-1, n=2: the second choice samples with seed 0), so any valid
    seed serves any n, reproducibly. The seed is checked first: 2**64 must not wrap to 0."""
    return None if seed is None else (require_seed(seed, field) + choice) % SEED_LIMIT


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt -> same output; 0 <= seed < 2**64
    logit_bias: dict[int, float] = field(default_factory=dict)

    @cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (ids, values) tensors, built once: LMQL sends masks of ~50k entries
        and they are applied at every step."""
        ids = torch.tensor(list(self.logit_bias.keys()), dtype=torch.long)
        return ids, torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """Raise InvalidValueError naming the first value of the wrong type or out of range
        (`names`: a protocol's own field names, as for GenerateOptions.validate)."""
        given = names or {}

        def name(field: str) -> str:
            return given.get(field, field)

        require_number(self.temperature, name("temperature"), lo=0)
        require_int(self.top_k, name("top_k"), lo=0)
        top_p = require_number(self.top_p, name("top_p"))
        if not 0 < top_p <= 1:
            raise InvalidValueError(name("top_p"), f"{name('top_p')} must be in (0, 1], got {top_p}")
        if self.seed is not None:
            require_seed(self.seed, name("seed"))
        bias = name("logit_bias")
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool):
                raise InvalidValueError(bias, f"{bias}: key {shown(token)} is not a token id")
            require_number(value, bias, what=f"{bias}[{token}]")


@dataclass
class GenerateOptions:
    max_tokens: int = 16  # 0 = prefill only
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()  # stop strings, matched on the decoded completion
    ignore_eos: bool = False
    # logprobs: positions covered get the token's logprob and `top_logprobs` alternatives.
    # None = every generated position; prompt positions only when named in logprob_ranges.
    logprob_ranges: Ranges | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # "raw": log-softmax of the model's logits; "processed": after logit_bias and the
    # constraint mask (what LMQL's LMTP server reports).
    logprob_mode: str = "raw"
    readout_ranges: Ranges = ()  # positions that get concept readouts
    priority: int = 5  # 0 interactive ... 10 batch
    constraint: Constraint | None = None
    use_prefix_cache: bool = True  # False forces recomputation (benchmarks, debugging)
    origin: Origin | None = None  # who asked (access log, metrics)
    # TokenEvent.text of special tokens (end of turn, BOS): "" unless asked for; ids stay exact
    special_text: bool = False
    # False: no prompt-lookup guesses for this request (engine/speculation.py; --speculate)
    speculate: bool = True

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """Raise InvalidValueError for a value of the wrong type or out of range. `names` renames
        fields in the messages (a protocol's own field names, e.g. {"logprob_ranges":
        "logprobs_ranges"})."""
        names = names or {}
        require_int(self.max_tokens, names.get("max_tokens", "max_tokens"), lo=0)
        require_int(self.priority, names.get("priority", "priority"), 0, 10)
        require_int(self.top_logprobs, names.get("top_logprobs", "top_logprobs"), lo=0)
        if self.logprob_mode not in ("raw", "processed"):
            raise InvalidValueError(
                "logprob_mode", f"logprob_mode must be 'raw' or 'processed', got {self.logprob_mode!r}"
            )
        for field_name, ranges in (
            ("logprob_ranges", self.logprob_ranges or ()),
            ("readout_ranges", self.readout_ranges),
        ):
            name = names.get(field_name, field_name)
            for i, (start, end) in enumerate(ranges):
                require_int(start, name, what=f"{name}[{i}] start")
                require_int(end, name, what=f"{name}[{i}] end")
                if start < 0:
                    raise InvalidValueError(name, f"{name}[{i}]: negative start {start}")
                if end < start:
                    raise InvalidValueError(name, f"{name}[{i}]: start {start} > end {end}")
        self.sampling.validate(names)


@dataclass(frozen=True)
class Origin:
    """Who asked: for the access log and the per-protocol metrics (the engine only passes it on)."""

    protocol: str  # "salience", "lmtp", ...
    method: str  # the protocol's RPC, message or action: "Generate", "GENERATE", ...
    peer: str | None = None  # the client's address


@dataclass
class TokenEvent:
    token_id: int
    position: int
    is_prefill: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    readout: torch.Tensor | None = None  # [n_layers, n_concepts]
    text: str = ""  # decoded text this token completes (generated tokens only)
    forced: bool = False  # appended by a constraint, not sampled
    # set on the token that ends generation (eos, stop, length): the FinishEvent that follows
    # carries the same reason, so a protocol can close its last record without waiting for it
    finish_reason: FinishReason | None = None


@dataclass
class BacktrackEvent:
    """A constraint removed the last `count` generated tokens; the session now has `length`."""

    count: int
    length: int


@dataclass
class FinishEvent:
    """The last event of every request: why it ended and its usage (token counts)."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    stop_detail: Any = None  # the stop string or stop token id that ended generation
    # an "error" because the engine running the request went away (a lost --replicas replica):
    # protocols answer it as unavailable (retry elsewhere), not as an internal failure
    unavailable: bool = False
    # an "error" the request's own input caused (its constraint's grammar failed mid-generation,
    # e.g. past llguidance's lexer limits): protocols answer it as invalid input, not internal
    bad_input: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


Event = TokenEvent | BacktrackEvent | FinishEvent


class RequestHandle(ABC):
    """The caller's end of a request, on this process's engine or on a replica (scale/handle.py):
    its events, by `subscribe` (the one way to read them), and `cancel`."""

    def __init__(self, feed: EventFeed[Event]) -> None:
        self._feed = feed

    @property
    @abstractmethod
    def session_id(self) -> str:
        raise NotImplementedError

    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """Prompt positions whose KV was reused (the session's own or the prefix cache's)."""
        raise NotImplementedError

    @property
    @abstractmethod
    def finished(self) -> bool:
        """Whether the request ended (its FinishEvent is emitted or on its way)."""
        raise NotImplementedError

    @abstractmethod
    def cancel(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def queue_position(self) -> int | None:
        """How many requests are admitted before this one (0 = next), or None once it runs or
        ended (or where it is not known)."""
        raise NotImplementedError

    def subscribe(self, sink: Callable[[Event], None]) -> None:
        """Deliver events by calling sink(event) on the thread that emits them (the model thread
        with the engine lock held, or a replica's pump thread), in order, ending with the
        FinishEvent; events emitted before this call are passed on first, on the calling thread.
        The sink must be quick and must not raise. Once per request. Asyncio code subscribes an
        EventChannel (engine/events.py) or reads `stream_events(handle)`; a thread
        reads `iter_events(handle)`."""
        self._feed.subscribe(sink)

    def result(self) -> tuple[list[TokenEvent], FinishEvent]:
        """Block until the request ends: its events before the FinishEvent, and that (scripts,
        tests and benchmarks; it subscribes, so nothing else may)."""
        tokens: list[TokenEvent] = []
        for event in iter_events(self):
            if isinstance(event, FinishEvent):
                return tokens, event
            tokens.append(event)  # type: ignore[arg-type]  # a backtrack rides along, as it came
        raise AssertionError("unreachable: iter_events ends with the FinishEvent")


class EngineHandle(RequestHandle):
    """A request on this process's Engine."""

    def __init__(
        self,
        request: Request,
        cancel: Callable[[Request], None],
        queue_position: Callable[[Request], int | None],
    ) -> None:
        super().__init__(request.feed)
        self._request = request
        self._cancel = cancel
        self._queue_position = queue_position

    @property
    def session_id(self) -> str:
        return self._request.session.id

    @property
    def cached_tokens(self) -> int:
        return self._request.cached_tokens or 0

    @property
    def finished(self) -> bool:
        return self._request.finished

    @property
    def generated(self) -> int:
        """Tokens generated so far (a replica's load report reads it)."""
        return self._request.generated

    def cancel(self) -> None:
        self._cancel(self._request)

    def queue_position(self) -> int | None:
        return self._queue_position(self._request)


def iter_events(handle: RequestHandle) -> Iterator[Event]:
    """A request's events, blocking for each, ending with its FinishEvent (a thread's reader:
    the CLI, benchmarks, tests). It subscribes at the first `next`."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    handle.subscribe(events.put)
    while not isinstance(event := events.get(), FinishEvent):
        yield event
    yield event


async def stream_events(handle: RequestHandle) -> AsyncIterator[Event]:
    """A request's events on the running loop, ending with its FinishEvent. Leaving early (the
    client disconnected) cancels the request."""
    channel: EventChannel[Event] = EventChannel()
    handle.subscribe(channel.push)
    try:
        async for batch in channel:
            for event in batch:
                yield event
                if isinstance(event, FinishEvent):
                    return
    finally:
        if not handle.finished:
            handle.cancel()


class Request:
    """Engine-side state of one generate call. Mutated only under the engine lock."""

    def __init__(self, rid: int, session: Session, options: GenerateOptions, prompt_len: int) -> None:
        self.id = rid
        self.session = session
        self.options = options
        self.prompt_len = prompt_len  # session length when generation starts
        self.generated = 0
        # timing for the access log and the latency metrics (time.monotonic())
        self.arrived = time.monotonic()
        self.token_times: list[float] = []  # when each generated token was sampled or forced
        self.finished = False
        self.feed: EventFeed[Event] = EventFeed()  # to the handle's subscriber
        # which positions owe logprobs / readouts, and those results until their events are due
        self.positions: PositionOutputs[TokenEvent] = PositionOutputs(
            prompt_len, options.logprob_ranges, options.logprobs, options.readout_ranges
        )
        self.started = False  # prefix cache consulted since (re)admission
        # prompt positions whose KV was reused, not computed (session KV + prefix cache hits),
        # counted at first admission; None until then
        self.cached_tokens: int | None = None
        self.disk_tokens = 0  # of those, read from the block files (engine/persistence.py)
        # set by admission.prepare
        self.generator: torch.Generator | None = None
        self.decoder: IncrementalDecoder | None = None
        self.stopper: StopStringMatcher | None = None  # only with stop strings
        # its guesses of the next tokens, where the engine speculates (engine/speculation.py)
        self.speculator: Speculator | None = None

    def emit(self, event: Event) -> None:
        self.feed.push(event)
