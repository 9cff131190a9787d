"""WasmController: a Wasm module (tokenwire controller ABI v1, see abi.py) run in wasmtime.

Limits: fuel (`ControllerLimits.wasm_fuel` per callback), the callback's CPU time checked when it
returns, an epoch deadline per callback as a wall-clock backstop (one shared engine whose epoch a
daemon thread advances every millisecond; twice the CPU budget plus 10 ms) and a Store limiter on
linear memory (`memory_bytes`): memory.grow past it returns -1 to the module, instantiation of a
larger memory fails. A trap, fuel exhaustion or a nonzero return fails the sequence.

Clone: a fresh instance of the same compiled module with the parent's linear memory and exported
mutable globals copied in. Between callbacks the toolchains' shadow-stack pointer is back at its
initial value, so that copy is the whole state; the ABI requires any other mutable global to be
exported (see docs).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from wasmtime import (
    Config,
    Engine,
    Func,
    Global,
    Instance,
    Memory,
    Module,
    Store,
    Trap,
    TrapCode,
    WasmtimeError,
)

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
from tokenwire.protocols.aici.wasm.abi import EXPORTS, IMPORTS, sig

__all__ = ["WasmController", "compile_wasm", "wasm_engine"]

DISALLOWED = np.float32(-1e10)
EPOCH_TICK_S = 0.001
# CPU seconds tokenizing costs per input byte (measured 0.96 us a character with SmolLM2's
# tokenizer on the 2-core development VM): a tokenize call that cannot finish within the
# callback's time left is refused before it starts (tokenize of 15 MB took 18.5 s of a 1 s budget)
TOKENIZE_S_PER_BYTE = 1e-6
WALL_SLACK_S = 0.010  # epoch backstop slack beyond twice the CPU budget (preemption)
_engine_lock = threading.Lock()
_engine: Engine | None = None


def _epoch_ticks(cpu_budget_s: float) -> int:
    """Epochs follow the wall clock, budgets count CPU time: the epoch deadline is a backstop
    with slack for preemption (twice the budget plus 10 ms); fuel bounds the compute, and the
    CPU time is checked when the call returns."""
    return max(1, int((2 * max(cpu_budget_s, 0.0) + WALL_SLACK_S) / EPOCH_TICK_S) + 1)


def wasm_engine() -> Engine:
    """The process-wide wasmtime engine (fuel + epochs on) and its epoch ticker."""
    global _engine
    with _engine_lock:
        if _engine is None:
            cfg = Config()
            cfg.consume_fuel = True
            cfg.epoch_interruption = True
            _engine = Engine(cfg)
            engine = _engine

            def tick() -> None:
                while True:
                    time.sleep(EPOCH_TICK_S)
                    engine.increment_epoch()

            threading.Thread(target=tick, name="tw-wasm-epoch", daemon=True).start()
        return _engine


def compile_wasm(binary: bytes) -> tuple[Module, int]:
    """Compile and check a controller module: (module, compiled size in bytes)."""
    try:
        module = Module(wasm_engine(), binary)
    except WasmtimeError as e:
        raise ControllerError(f"wasm: invalid module: {e}") from None
    for imp in module.imports:
        if imp.module != "tw" or imp.name not in IMPORTS:
            raise ControllerError(
                f'wasm: unknown import {imp.module}.{imp.name} (only "tw" host functions exist)'
            )
    exports = {e.name for e in module.exports}
    missing = [n for n in EXPORTS if n not in exports]
    if missing:
        raise ControllerError(
            f"wasm: module does not export {', '.join(missing)} (tokenwire controller ABI v1)"
        )
    return module, len(module.serialize())


class WasmController(Controller):
    """One sequence's Wasm controller instance; `arg` is the request's controller_arg."""

    def __init__(
        self,
        env: TokenizerEnv,
        variables: VariableStore,
        limits: ControllerLimits,
        module: Module,
        arg: str,
        *,
        fork_index: int = 0,
    ) -> None:
        super().__init__(env, variables, limits)
        self.module = module
        self.arg = arg.encode("utf-8")
        self.fork_index = fork_index
        self.failed: str | None = None
        self._res: dict[str, Any] = {}
        self._deadline = time.thread_time() + limits.init_s  # of the callback running now
        self._store = Store(wasm_engine())
        # everything the module can make wasmtime allocate: linear memory, table elements (a
        # 191-byte module's table.grow added 618 MiB) and the number of instances, tables and
        # memories (the ABI needs one memory; toolchains emit one function table)
        self._store.set_limits(
            memory_size=int(limits.memory_bytes),
            table_elements=int(limits.max_table_elements),
            instances=1,
            tables=2,
            memories=1,
        )
        self._store.set_fuel(int(limits.wasm_fuel))
        # the start function and data segments run here: within the instantiate budget
        self._store.set_epoch_deadline(_epoch_ticks(limits.init_s))
        try:
            self._instance = Instance(self._store, module, self._imports())
        except (WasmtimeError, Trap) as e:
            raise self._fail(ControllerError(f"wasm: instantiation failed: {_short(e)}")) from None
        ex = self._instance.exports(self._store)
        self._memory: Memory = ex["memory"]
        self._fn = {n: ex[n] for n in EXPORTS if n != "memory"}

    # ---- callbacks --------------------------------------------------------------------------------

    def init_prompt(self, prompt: list[int], deadline: float) -> list[int]:
        ptr = self._write_tokens(prompt, deadline)
        self._call("init_prompt", deadline, ptr, len(prompt))
        return list(prompt)

    def pre_process(self, deadline: float) -> PreResult:
        r = self._call("pre_process", deadline)
        return PreResult(
            suspend=r.get("suspend", False), num_forks=r.get("num_forks", 1), ff_tokens=r.get("ff", [])
        )

    def mid_process(self, deadline: float) -> MidResult:
        r = self._call("mid_process", deadline)
        if r.get("ff") or r.get("backtrack"):
            return MidResult(ff_tokens=r.get("ff", []), backtrack=r.get("backtrack", 0))
        return MidResult(bias=r.get("bias"))

    def post_process(self, backtrack: int, tokens: list[int], deadline: float) -> PostResult:
        ptr = self._write_tokens(tokens, deadline)
        r = self._call("post_process", deadline, int(backtrack), ptr, len(tokens))
        return PostResult(stop=r.get("stop", False))

    def clone(self, fork_index: int) -> WasmController:
        if self.failed is not None:
            raise ControllerError(f"wasm: cannot fork a failed controller: {self.failed}")
        other = WasmController(
            self.env, self.variables, self.limits, self.module, self.arg.decode(), fork_index=fork_index
        )
        size = self._memory.data_len(self._store)
        grow = (size - other._memory.data_len(other._store)) // 65536
        if grow > 0 and not other._memory.grow(other._store, grow):
            raise ControllerError("wasm: clone could not grow its memory")
        other._memory.write(other._store, self._memory.read(self._store, 0, size), 0)
        mine = self._instance.exports(self._store)
        theirs = other._instance.exports(other._store)
        for name, item in mine.items():
            if isinstance(item, Global) and item.type(self._store).mutable:
                theirs[name].set_value(other._store, item.value(self._store))
        return other

    def close(self) -> None:
        """Drop the store now. The host functions close over `self` and wasmtime keeps them in a
        process-wide table until their store is deleted, so a controller that kept its store was
        never freed (its linear memory stayed resident)."""
        self.failed = self.failed or "closed"
        self._res = {}
        self._fn = {}
        self._memory = None  # type: ignore[assignment]
        self._instance = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]

    # ---- plumbing -----------------------------------------------------------------------------------

    def _call(self, name: str, deadline: float, *args: int) -> dict[str, Any]:
        if self.failed is not None:
            raise ControllerError(f"wasm: controller already failed: {self.failed}")
        remaining = deadline - time.thread_time()
        if remaining <= 0:
            raise self._fail(ControllerTimeout(f"wasm: no time left for {name}"))
        self._res = {}
        self._deadline = deadline
        self._store.set_fuel(int(self.limits.wasm_fuel))
        self._store.set_epoch_deadline(_epoch_ticks(remaining))
        try:
            code = self._fn[name](self._store, *args)
        except Trap as e:
            msg = _short(e)
            code = getattr(e, "trap_code", None)
            if code == TrapCode.INTERRUPT:
                raise self._fail(ControllerTimeout(f"wasm: {name} ran past its deadline")) from None
            if code == TrapCode.OUT_OF_FUEL:
                raise self._fail(
                    ControllerTimeout(f"wasm: {name} ran out of fuel ({self.limits.wasm_fuel})")
                ) from None
            raise self._fail(ControllerError(f"wasm: {name} trapped: {msg}")) from None
        except (WasmtimeError, ControllerError) as e:
            raise self._fail(
                e if isinstance(e, ControllerError) else ControllerError(f"wasm: {name}: {_short(e)}")
            ) from None
        if time.thread_time() > deadline:
            raise self._fail(ControllerTimeout(f"wasm: {name} ran past its deadline"))
        if code:
            raise self._fail(ControllerError(f"wasm: {name} returned error code {code}"))
        return self._res

    def _write_tokens(self, tokens: list[int], deadline: float) -> int:
        if not tokens:
            return 0
        data = np.asarray(tokens, dtype="<i4").tobytes()
        ptr = self._alloc(len(data), deadline)
        self._memory.write(self._store, data, ptr)
        return ptr

    def _alloc(self, size: int, deadline: float) -> int:
        self._store.set_fuel(int(self.limits.wasm_fuel))
        self._store.set_epoch_deadline(_epoch_ticks(deadline - time.thread_time()))
        try:
            ptr = self._fn["tw_alloc"](self._store, size)
        except (Trap, WasmtimeError) as e:
            raise self._fail(ControllerError(f"wasm: tw_alloc failed: {_short(e)}")) from None
        if not isinstance(ptr, int) or ptr <= 0 or ptr + size > self._memory.data_len(self._store):
            raise self._fail(ControllerError(f"wasm: tw_alloc({size}) returned an invalid pointer {ptr}"))
        return ptr

    def _fail(self, err: ControllerError) -> ControllerError:
        if self.failed is None:
            self.failed = str(err)
            self.log(f"{err}\n")
        return err

    # memory helpers used by the host functions
    def _read(self, ptr: int, n: int) -> bytes:
        if ptr < 0 or n < 0 or ptr + n > self._memory.data_len(self._store):
            raise ControllerError(f"wasm: out-of-bounds host access ({ptr}, {n})")
        return bytes(self._memory.read(self._store, ptr, ptr + n))

    def _write(self, ptr: int, data: bytes) -> None:
        if ptr < 0 or ptr + len(data) > self._memory.data_len(self._store):
            raise ControllerError(f"wasm: out-of-bounds host access ({ptr}, {len(data)})")
        self._memory.write(self._store, data, ptr)

    def _tokens(self, ptr: int, n: int) -> list[int]:
        if n > self.limits.max_ff_tokens:  # before 4n bytes become n Python ints
            raise ControllerError(
                f"wasm: {n} tokens, the limit is {self.limits.max_ff_tokens} (--max-ff-tokens)"
            )
        ids = np.frombuffer(self._read(ptr, 4 * n), dtype="<i4").tolist()
        bad = [t for t in ids if not 0 <= t < self.env.vocab_size]
        if bad:
            raise ControllerError(f"wasm: invalid token id {bad[0]}")
        return ids

    def _bias(self) -> np.ndarray:
        if "bias" not in self._res:
            self._res["bias"] = np.zeros(self.env.vocab_size, dtype=np.float32)
        return self._res["bias"]

    def _imports(self) -> list[Func]:
        env = self.env
        impl: dict[str, Callable[..., Any]] = {
            "arg_len": lambda: len(self.arg),
            "arg_read": lambda p, cap: self._write(p, self.arg[:cap]) or min(cap, len(self.arg)),
            "vocab_size": lambda: env.vocab_size,
            "eos_token": lambda: env.eos_token_id,
            "fork_index": lambda: self.fork_index,
            "tokenize": self._h_tokenize,
            "token_bytes": lambda t, p, cap: self._copy_out(
                env.token_bytes[t] if 0 <= t < len(env.token_bytes) else b"", p, cap
            ),
            "var_get": self._h_var_get,
            "var_set": self._h_var_set,
            "log": self._h_log,
            "set_suspend": lambda: self._res.__setitem__("suspend", True),
            "set_num_forks": lambda n: self._res.__setitem__("num_forks", int(n)),
            "set_ff_tokens": lambda p, n: self._res.__setitem__("ff", self._tokens(p, n)),
            "set_backtrack": lambda n: self._res.__setitem__("backtrack", max(0, int(n))),
            "bias_disallow_all": lambda: self._bias().fill(DISALLOWED),
            "bias_allow_all": lambda: self._bias().fill(0.0),
            "bias_allow": lambda t: self._bias().__setitem__(self._tok(t), 0.0),
            "bias_disallow": lambda t: self._bias().__setitem__(self._tok(t), DISALLOWED),
            "bias_allow_bits": self._h_allow_bits,
            "set_stop": lambda: self._res.__setitem__("stop", True),
        }
        funcs = []
        for imp in self.module.imports:
            params, results = IMPORTS[imp.name]
            funcs.append(Func(self._store, sig(params, results), _guarded(impl[imp.name])))
        return funcs

    def _tok(self, t: int) -> int:
        if not 0 <= t < self.env.vocab_size:
            raise ControllerError(f"wasm: invalid token id {t}")
        return t

    def _copy_out(self, data: bytes, ptr: int, cap: int) -> int:
        self._write(ptr, data[: max(0, cap)])
        return len(data)

    def _h_log(self, p: int, n: int) -> None:
        # only what the log cap still takes is read (a loop of log(ptr, 60 MB) reached 13 GB)
        room = self.log_room()
        if room > 0:
            self.log(self._read(p, min(max(0, n), room + 1)).decode("utf-8", "replace"))

    def _h_tokenize(self, p: int, n: int, out: int, cap: int) -> int:
        limit = self.limits.max_host_input
        if n > limit:
            raise ControllerError(f"wasm: tokenize of {n} bytes, the limit is {limit} (--max-host-input-kb)")
        left = self._deadline - time.thread_time()
        if n * TOKENIZE_S_PER_BYTE > left:
            raise ControllerTimeout(
                f"wasm: tokenize of {n} bytes needs more time than the callback has left "
                f"({max(left, 0.0) * 1e3:.1f} ms)"
            )
        ids = self.env.tokenize(self._read(p, n).decode("utf-8", "replace"))
        self._write(out, np.asarray(ids[: max(0, cap)], dtype="<i4").tobytes())
        return len(ids)

    def _h_var_get(self, p: int, n: int, out: int, cap: int) -> int:
        value = self.variables.get(self._read(p, n).decode("utf-8", "replace"))
        return -1 if value is None else self._copy_out(value, out, cap)

    def _h_var_set(self, p: int, n: int, vp: int, vn: int, append: int) -> None:
        if n + vn > self.limits.max_var_bytes:  # before reading it out of linear memory
            raise ControllerError(
                f"wasm: a variable of {n + vn} bytes, the limit is {self.limits.max_var_bytes} (--max-var-kb)"
            )
        name = self._read(p, n).decode("utf-8", "replace")
        self.add_storage(self.variables.set(name, self._read(vp, vn), append=bool(append)))

    def _h_allow_bits(self, p: int) -> None:
        words = np.frombuffer(self._read(p, 4 * ((self.env.vocab_size + 31) // 32)), dtype="<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=self.env.vocab_size).astype(bool)
        self._bias()[bits] = 0.0


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Host errors become traps carrying their message (wasmtime turns exceptions into traps)."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except ControllerError as e:
            raise Trap(str(e)) from None
        except Exception as e:
            raise Trap(f"host function failed: {type(e).__name__}: {e}") from None

    return call


def _short(e: BaseException) -> str:
    """The message without wasmtime's backtrace lines."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    keep = [
        ln
        for ln in lines
        if not ln.startswith(("error while executing", "wasm backtrace", "0:", "1:", "2:", "3:"))
    ]
    keep = [ln for ln in keep if not re.match(r"^\d+:", ln) and not ln.startswith("note:")]
    return "; ".join(keep[:2]) if keep else (lines[0] if lines else type(e).__name__)
