"""JsController: a jsctrl program (JavaScript, QuickJS) as one sequence's AICI controller.

Each controller owns one QuickJS context (its own runtime, so memory limits are per sequence)
loaded with our glue (glue.js) and the program. The glue keeps what the program is waiting on
(a "NextToken": fixed text, a constrained token, a fork, a variable wait); the callbacks below
ask it for pre/mid/post results and then run QuickJS's pending promise jobs, which is where
the program's async code advances.

Time limits. The `quickjs` binding's CPU-time interrupt refuses host calls while a limit is set
("Can not call into Python with a time limit set"), and host calls are the whole API. Its
interrupt handler is installed when a call starts with a limit set and left installed if the
limit is cleared before the call ends. So each callback: (1) registers a one-shot object
`__tw_unlock` whose finalizer clears the limit, (2) sets the limit to the time left, (3) enters
the glue, whose first statement deletes `__tw_unlock` (QuickJS frees it at once, the limit is
cleared, host calls work) while the handler stays armed for this callback's window, which also
covers the promise jobs run afterwards. Past the deadline QuickJS raises "interrupted" and we
raise ControllerTimeout; the wall clock is checked between jobs too. Memory: the runtime's
malloc limit (`ControllerLimits.memory_bytes`) makes allocation fail with "out of memory".

Forks (clone). A QuickJS context cannot be copied, so a clone is rebuilt by replay: a fresh
context runs the same program (same random seed) through the same recorded sequence of glue
calls, with variable reads served from the journal of the original, logs and variable writes
suppressed; every replayed call must return exactly what it returned the first time (checked).
The clone then resumes its `fork()` with its own index. Replay costs what the original run cost
up to the fork (masks included); programs fork early in practice.

Sandbox: the context has no std/os modules; the glue replaces Math.random with a seeded
generator and Date with a clock frozen at the epoch.

Protocol details (aicirt's, for the seed's protocol version):
* pre_process applies fast-forward tokens itself: when the program forces text, the tokens are
  fed back to the program at once (as aicirt does) and returned in PreResult.ff_tokens. The
  runtime must not pass these tokens to post_process again.
* mid_process returns either a bias, or a splice (MidResult.ff_tokens/backtrack with bias None)
  meaning "instead of sampling, drop `backtrack` tokens and append ff_tokens"; the next
  post_process then receives exactly that backtrack and those tokens. A finished program asks
  for EOS (bias allowing only EOS), then post_process returns stop.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from importlib import resources
from typing import Any

import numpy as np
import quickjs

from tokenwire.protocols.aici.controller import (
    Controller,
    ControllerError,
    ControllerLimits,
    ControllerTimeout,
    MidResult,
    PostResult,
    PreResult,
    TokenizerEnv,
    VariableStore,
)
from tokenwire.protocols.aici.jsctrl.host import JsHost
from tokenwire.protocols.aici.jsctrl.source import SourceError, prepare_source

__all__ = ["JsController", "words_from_mask_hex"]

MAX_PRE_ROUNDS = 10  # fixed-text rounds in one pre_process (aicirt's bound)
MAX_MID_ROUNDS = 20  # fork/waitVars steps skipped inside one mid_process
_GLUE = resources.files(__package__).joinpath("glue.js").read_text(encoding="utf-8")


class _Unlock:
    """Clears the context's time limit when QuickJS frees it (see the module docstring)."""

    def __init__(self, ctx: quickjs.Context) -> None:
        self.ctx = ctx

    def __call__(self) -> None:
        return None

    def __del__(self) -> None:
        self.ctx.set_time_limit(-1)


def words_from_mask_hex(mask_hex: str) -> np.ndarray:
    """Mask words (uint32, bit i of word w = token 32w+i) from the big-endian hex of a TokenSet
    the program built itself."""
    return np.frombuffer(bytes.fromhex(mask_hex), dtype=">u4").astype(np.uint32)


class JsController(Controller):
    """jsctrl: `source` is the JavaScript program (the request's controller_arg)."""

    def __init__(
        self,
        env: TokenizerEnv,
        variables: VariableStore,
        limits: ControllerLimits,
        source: str,
        *,
        seed: int | None = None,
    ) -> None:
        super().__init__(env, variables, limits)
        self.source = source
        self.seed = seed if seed is not None else zlib.crc32(source.encode("utf-8", "replace"))
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._journal: list[tuple[str, dict[str, Any], str]] = []  # (entry, args, result JSON)
        self._pending_fork: int | None = None
        self._replay: list[tuple[str, dict[str, Any], str]] | None = None
        self._host = JsHost(env, variables, self.log, self.add_storage, self.seed, limits.max_host_input)
        self._ctx = quickjs.Context()
        self._ctx.set_memory_limit(int(limits.memory_bytes))
        for name, fn in self._host.functions().items():
            self._ctx.add_callable("__tw_n_" + name, fn)
        try:
            self._ctx.eval(_GLUE)
        except quickjs.JSException as e:  # only if memory_bytes is too small for the glue itself
            raise ControllerError(f"jsctrl: cannot load the glue: {_first_line(e)}") from e
        self._entry = self._ctx.get("__tw_call")

    # ---- the Controller callbacks ---------------------------------------------------------------

    def init_prompt(self, prompt: list[int], deadline: float) -> list[int]:
        try:
            program = prepare_source(self.source)
        except SourceError as e:
            raise self._fail(ControllerError(f"jsctrl: {e}")) from None
        with self._lock:
            self._call("init_prompt", {"prompt": list(prompt)}, deadline)
            self._call("run_script", {"source": program}, deadline)
        return list(prompt)

    def pre_process(self, deadline: float) -> PreResult:
        with self._lock:
            self._resume_fork(deadline)
            ff: list[int] = []
            for _ in range(MAX_PRE_ROUNDS + 1):
                r = self._call("pre", {}, deadline)
                if r["forks"] == 0:  # the program has finished
                    return PreResult(num_forks=1 if ff else 0, ff_tokens=ff)
                if not r["ff"]:
                    if r["forks"] > 1:
                        self._pending_fork = 0  # this controller is fork 0; clones get 1..n-1
                    return PreResult(suspend=r["suspend"], num_forks=r["forks"], ff_tokens=ff)
                if r["forks"] != 1 or r["suspend"]:
                    raise self._fail(
                        ControllerError("jsctrl: pre_process cannot fork or suspend with ff_tokens")
                    )
                ff.extend(r["ff"])
                if self._call("post", {"backtrack": 0, "tokens": r["ff"]}, deadline)["stop"]:
                    return PreResult(num_forks=1, ff_tokens=ff)
            raise self._fail(ControllerError("jsctrl: too many fixed-text rounds in one pre_process"))

    def mid_process(self, deadline: float) -> MidResult:
        with self._lock:
            reentry = self._resume_fork(deadline)
            for _ in range(MAX_MID_ROUNDS):
                if reentry:
                    self._call("reentry_pre", {}, deadline)
                r = self._call("mid", {}, deadline)
                if not r.get("skip"):
                    break
                self._call("skip", {}, deadline)
                reentry = True
            else:
                raise self._fail(ControllerError("jsctrl: too many skipped steps in one mid_process"))
        # masks, not float rows: the runtime expands every mask of a step into the bin region in
        # one pass (allowed 0, else -inf, as AICI's runtime writes them)
        if r.get("stop"):
            eos = self.env.eos_token_id
            words = np.zeros((self.env.vocab_size + 31) // 32, dtype=np.uint32)
            words[eos >> 5] = np.uint32(1 << (eos & 31))
            return MidResult(mask=words)
        if "ff" in r:
            return MidResult(ff_tokens=list(r["ff"]), backtrack=int(r["backtrack"]))
        if r.get("bias") is None:
            return MidResult()
        mask = r["bias"]
        if mask.startswith("@"):  # a host mask the program passed on untouched
            try:
                words = self._host.mask(int(mask[1:]))
            except ValueError as e:
                raise self._fail(ControllerError(f"jsctrl: {e}")) from None
            return MidResult(mask=words)
        try:
            return MidResult(mask=words_from_mask_hex(mask))
        except ValueError as e:
            raise self._fail(ControllerError(f"jsctrl: a malformed token mask: {e}")) from None

    def post_process(self, backtrack: int, tokens: list[int], deadline: float) -> PostResult:
        with self._lock:
            r = self._call("post", {"backtrack": int(backtrack), "tokens": list(tokens)}, deadline)
            return PostResult(stop=bool(r["stop"]) or self._state(deadline)["done"])

    def clone(self, fork_index: int) -> JsController:
        with self._lock:
            if self.failed is not None:
                raise ControllerError(f"jsctrl: cannot fork a failed controller: {self.failed}")
            other = JsController(self.env, self.variables, self.limits, self.source, seed=self.seed)
            other._replay_from(self._journal, list(self._host.var_reads))
            other._pending_fork = int(fork_index)
            return other

    def close(self) -> None:
        """Drop the QuickJS context now (the runtime does this when a sequence is freed): the
        context holds the host functions, which hold this controller, a cycle the garbage
        collector cannot see through the C object."""
        with self._lock:
            self._drop_context()

    def _drop_context(self) -> None:
        self._entry = None
        self._ctx = None  # type: ignore[assignment]
        self._host.constraints.clear()
        self._host.grammar_sizes.clear()
        self._host.masks.clear()

    # ---- internals --------------------------------------------------------------------------------

    def _resume_fork(self, deadline: float) -> bool:
        if self._pending_fork is None:
            return False
        index, self._pending_fork = self._pending_fork, None
        self._call("fork", {"index": index}, deadline)
        return True

    def _replay_from(
        self, journal: list[tuple[str, dict[str, Any], str]], reads: list[tuple[str, str | None]]
    ) -> None:
        self._host.replay_reads = reads
        budget = self.limits.init_s + len(journal) * max(self.limits.mid_s, self.limits.pre_s)
        deadline = time.thread_time() + budget
        try:
            self._replay = list(journal)
            with self._lock:
                for name, args, _ in journal:
                    self._call(name, args, deadline)
            if self._replay or self._host.replay_reads:
                raise ControllerError("jsctrl: replay for fork ended early")
        finally:
            self._replay = None
            self._host.replay_reads = None

    def _call(self, name: str, args: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Run one glue entry and the promise jobs it released, under `deadline`."""
        if self.failed is not None:
            raise ControllerError(f"jsctrl: controller already failed: {self.failed}")
        if self._ctx is None:
            raise ControllerError("jsctrl: controller was closed")
        ctx = self._ctx
        remaining = deadline - time.thread_time()
        if remaining <= 0:
            raise self._fail(ControllerTimeout(f"jsctrl: no time left for {name}"))
        ctx.add_callable("__tw_unlock", _Unlock(ctx))
        self._host.deadline = deadline
        ctx.set_time_limit(remaining)
        try:
            out = self._entry(name, json.dumps(args))
            while True:
                if time.thread_time() > deadline:
                    raise self._fail(ControllerTimeout(f"jsctrl: {name} ran past its deadline"))
                if not ctx.execute_pending_job():
                    break
        except quickjs.JSException as e:
            raise self._fail(_js_error(name, e)) from None
        finally:
            ctx.set_time_limit(-1)
        if time.thread_time() > deadline:
            raise self._fail(ControllerTimeout(f"jsctrl: {name} ran past its deadline"))
        state = self._state(deadline)
        if state["error"]:
            raise self._fail(_program_error(state["error"], ctx.memory()))
        if self._replay is not None:
            expected = self._replay.pop(0)
            if expected[0] != name or expected[2] != out:
                raise self._fail(ControllerError(f"jsctrl: replay for fork diverged at {name}"))
        else:
            self._journal.append((name, args, out))
        return json.loads(out)

    def _state(self, deadline: float) -> dict[str, Any]:
        try:
            return json.loads(self._entry("state", "{}"))
        except quickjs.JSException as e:
            raise self._fail(_js_error("state", e)) from None

    def _fail(self, err: ControllerError) -> ControllerError:
        if self.failed is None:
            self.failed = str(err)
            self.log(f"{err}\n")
        # a failed controller is never called again; a context that ran out of memory may be
        # inconsistent, and all of them hold up to the memory limit: drop it now (no lock: the
        # callers hold it)
        if self._ctx is not None:
            self._drop_context()
        return err


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _js_error(name: str, e: quickjs.JSException) -> ControllerError:
    text = str(e).strip()
    if "interrupted" in _first_line(e):
        return ControllerTimeout(f"jsctrl: {name} ran past its deadline (interrupted)")
    if "out of memory" in _first_line(e) or isinstance(e, quickjs.StackOverflow):
        return ControllerError(f"jsctrl: {name}: {_first_line(e)} (memory limit)")
    return ControllerError(f"jsctrl: {name}: {text}")


def _program_error(text: str, memory: dict[str, int]) -> ControllerError:
    if text.startswith("InternalError: interrupted"):
        return ControllerTimeout("jsctrl: the program ran past its deadline (interrupted)")
    # QuickJS out of memory while it builds the error object throws null instead (seen about one
    # run in six of the allocating test program). At its limit the context says which it was; but
    # QuickJS frees by reference count, so what ran out is often freed before we look, and a
    # null the program threw itself reads the same: then the message names both
    limit = memory.get("malloc_limit", -1)
    if text == "null" and limit > 0:
        if memory.get("malloc_size", 0) >= 0.9 * limit:
            return ControllerError("jsctrl: the program failed: out of memory (memory limit)")
        return ControllerError(
            f"jsctrl: the program failed: null (thrown by the program, or by QuickJS out of memory "
            f"as it built the error: the memory limit is {limit / 2**20:g} MiB)"
        )
    return ControllerError(f"jsctrl: the program failed: {text}")
