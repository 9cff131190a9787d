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
    """Per-callback time limits (seconds), per-controller memory (bytes) and the caps on what a
    controller may ask of the runtime and the engine (docs/limits.md, "AICI controllers")."""

    pre_s: float = 0.001
    mid_s: float = 0.020
    post_s: float = 0.001
    init_s: float = 1.0
    memory_bytes: int = 64 * 2**20
    wasm_fuel: int = 2_000_000_000
    # forks one pre_process may ask for (--max-forks): the engine makes a sequence, a session and
    # a bias row per fork, and the bin region holds 341 rows of the 49,152-token vocabulary
    max_forks: int = 64
    # tokens one callback may fast-forward (--max-ff-tokens): SmolLM2's whole context; the
    # published mapping.js splices ~3,000 at a time
    max_ff_tokens: int = 8192
    # log bytes one instance may hold between two replies (--max-log-kb): 128 sequences of
    # logs at the cap fit the 32 MiB reply channel
    max_log_bytes: int = 256 * 2**10
    # bytes of shared variables of one run, and of the storage ops one instance holds between
    # two replies (--max-var-kb)
    max_var_bytes: int = 4 * 2**20
    # bytes of text or grammar one host call takes (--max-host-input-kb): tokenizing 1 MiB
    # takes ~1 s of CPU (measured 0.96 us a character), the instantiate budget
    max_host_input: int = 2**20
    # Wasm table elements (--max-wasm-table): a 191-byte module's table.grow took 618 MiB
    max_table_elements: int = 65536


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

    def __init__(self, limit_bytes: int = 4 * 2**20) -> None:
        self.values: dict[str, bytes] = {}
        self.version = 0
        self.limit_bytes = limit_bytes
        self.size = 0  # bytes of all names and values

    def get(self, name: str) -> bytes | None:
        return self.values.get(name)

    def set(self, name: str, value: bytes, append: bool = False) -> dict[str, Any]:
        """Raises ControllerError, changing nothing, when the run's variables would pass the cap
        (checked before the new value is built: an append loop grew the runtime by GBs)."""
        old = self.values.get(name)
        old_size = 0 if old is None else len(name) + len(old)
        new_size = len(name) + len(value) + (len(old) if append and old is not None else 0)
        if self.size - old_size + new_size > self.limit_bytes:
            raise ControllerError(
                f"shared variables over their limit of {self.limit_bytes} bytes (--max-var-kb)"
            )
        self.values[name] = (old + value) if append and old is not None else value
        self.size += new_size - old_size
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
        self.log_bytes = 0  # held in `logs` (capped: limits.max_log_bytes)
        self.storage_bytes = 0  # held in `storage` (capped: limits.max_var_bytes)

    def log_room(self) -> int:
        """Bytes of log text this instance may still hold before its next reply."""
        return max(0, self.limits.max_log_bytes - self.log_bytes)

    def log(self, text: str) -> None:
        """Append to the logs, truncated with a marker once the instance holds its cap (a log
        loop took the runtime to 13 GB, then over the 32 MiB reply channel)."""
        room = self.log_room()
        if room <= 0:
            return
        if len(text) > room:  # characters >= bytes/4: cut by characters, count the cut
            marker = f"\n[logs truncated at {self.limits.max_log_bytes} bytes (--max-log-kb)]\n"
            text = text[: max(0, room - len(marker))] + marker
            self.log_bytes = self.limits.max_log_bytes
        else:
            self.log_bytes += len(text)
        self.logs.append(text)

    def add_storage(self, op: dict[str, Any]) -> None:
        """Record a variable write for the next reply (ControllerError past the cap)."""
        size = len(op.get("WriteVar", {}).get("value", ""))
        if self.storage_bytes + size > self.limits.max_var_bytes:
            raise ControllerError(
                f"variable writes of one step over {self.limits.max_var_bytes} bytes (--max-var-kb)"
            )
        self.storage_bytes += size
        self.storage.append(op)

    def drain(self) -> tuple[str, list[dict[str, Any]]]:
        """The logs (AICI's string: each entry ends in a newline) and storage ops since the last
        drain; the caps start over."""
        lines, self.logs = self.logs, []
        storage, self.storage = self.storage, []
        self.log_bytes = self.storage_bytes = 0
        return "".join(ln if ln.endswith("\n") else ln + "\n" for ln in lines), storage

    def close(self) -> None:
        """Release what the instance holds (its QuickJS context, its wasmtime store) now: the
        runtime calls it when the sequence is freed, fails at instantiate or is dropped."""
        return None  # optional: declarative controllers hold nothing to release

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
