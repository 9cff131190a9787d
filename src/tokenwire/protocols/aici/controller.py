"""What the AICI runtime asks of a controller: the callbacks of the seed's protocol.

One Controller instance runs one sequence. The runtime calls, per step:
post_process (tokens the engine appended since the last call, after any backtrack), then
pre_process (may suspend, fork or fast-forward), then mid_process (the logit bias for the
next sampled token, or fast-forward / backtrack).

Which tokens post_process sees (the engine reports them in post_ops): the sampled token, or
the ff_tokens (and backtrack) that mid_process asked for. ff_tokens returned by pre_process
are NOT reported back: the controller already counts them as appended when it returns
them (the seed's example: pre ff_tokens = the fixed text, next post_ops tokens = [sampled]).

A fork makes clones: `clone(index)` gives the controller of fork `index` (0 keeps the
original), with the same state at that moment.

Every callback gets a `deadline`: a `time.thread_time()` value of the calling thread (CPU
time, not the wall clock: deadline.py says why). A controller must stop by then and raise
ControllerTimeout (QuickJS interrupt handler, wasmtime fuel/epochs, ...). Any
other exception fails only this controller's sequence; the runtime reports it in `error`.
Whatever the controller prints goes to `logs`, drained per call by the runtime.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Controller",
    "ControllerError",
    "ControllerLimits",
    "ControllerTimeout",
    "MidResult",
    "PostResult",
    "PreResult",
    "TokenizerEnv",
    "VariableStore",
]


class ControllerError(RuntimeError):
    """The controller failed (bad argument, script error, trap); fails its sequence only."""


class ControllerTimeout(ControllerError):
    """The controller ran past its deadline for one callback."""


@dataclass
class ControllerLimits:
    """Per-callback time limits (seconds) and per-controller memory (bytes)."""

    pre_s: float = 0.001
    mid_s: float = 0.020
    post_s: float = 0.001
    init_s: float = 1.0
    memory_bytes: int = 64 * 2**20
    wasm_fuel: int = 2_000_000_000


@dataclass
class TokenizerEnv:
    """What controllers may know about the tokenizer (shared, read-only)."""

    vocab_size: int  # rows of the bias region = the engine's vocab size
    eos_token_id: int
    token_bytes: list[bytes]  # token id -> its bytes
    tokenize: Callable[[str], list[int]]  # no special tokens added
    detokenize: Callable[[list[int]], bytes]
    ll_tokenizer: Any = None  # llguidance.LLTokenizer for grammar masks (built once)


@dataclass
class PreResult:
    suspend: bool = False
    num_forks: int = 1  # 0 = stop the sequence
    ff_tokens: list[int] = field(default_factory=list)


@dataclass
class MidResult:
    """The next token's constraint, in one of three forms (first that is set wins):

    * `matcher`: an llguidance LLMatcher whose next-token mask is the constraint. The runtime
      computes the masks of all such sequences of a step in one parallel llguidance call and
      expands them straight into the bin region (allowed 0, else -inf), minus `disallow` ids;
    * `mask`: the allowed tokens as 32-bit words (bit i of word w = token 32w+i), expanded alike;
    * `bias`: float32 [vocab_size] added to the logits (large negative = disallowed).
    None of them = no bias (all zeros). `ff_tokens`/`backtrack` = a splice instead of sampling.
    """

    bias: np.ndarray | None = None
    ff_tokens: list[int] = field(default_factory=list)
    backtrack: int = 0
    mask: np.ndarray | None = None  # int32/uint32 words [ceil(vocab/32)]
    matcher: Any = None  # llguidance.LLMatcher, mask computed by the runtime in a batch
    disallow: tuple[int, ...] = ()  # ids cleared from `mask`/`matcher`'s mask (e.g. EOS mid-program)


@dataclass
class PostResult:
    stop: bool = False


class VariableStore:
    """Variables shared by the sequences of one request (jsctrl's getVar/setVar/appendVar).

    Every write is recorded as a storage op ({"WriteVar": {...}}) for the `storage` field of
    the next reply of the sequence that made it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.version = 0

    def get(self, name: str) -> bytes | None:
        return self.values.get(name)

    def set(self, name: str, value: bytes, append: bool = False) -> dict[str, Any]:
        self.values[name] = (self.values.get(name, b"") + value) if append else value
        self.version += 1
        return {
            "WriteVar": {
                "name": name,
                "value": value.decode("utf-8", "replace"),
                "op": "Append" if append else "Set",
                "when_version_is": None,
            }
        }


class Controller(ABC):
    """One sequence's controller. Subclasses: declarative (llguidance), Wasm, jsctrl."""

    def __init__(self, env: TokenizerEnv, variables: VariableStore, limits: ControllerLimits) -> None:
        self.env = env
        self.variables = variables
        self.limits = limits
        self.logs: list[str] = []  # drained by the runtime after each call
        self.storage: list[dict[str, Any]] = []  # drained likewise

    def log(self, text: str) -> None:
        self.logs.append(text)

    @abstractmethod
    def init_prompt(self, prompt: list[int], deadline: float) -> list[int]:
        """Called once at instantiate; returns the token ids the sequence starts with."""

    @abstractmethod
    def pre_process(self, deadline: float) -> PreResult: ...

    @abstractmethod
    def mid_process(self, deadline: float) -> MidResult: ...

    @abstractmethod
    def post_process(self, backtrack: int, tokens: list[int], deadline: float) -> PostResult: ...

    @abstractmethod
    def clone(self, fork_index: int) -> Controller:
        """The controller of fork `fork_index` (>= 1) after pre_process asked for num_forks."""
