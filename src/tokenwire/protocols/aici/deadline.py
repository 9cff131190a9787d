"""Per-call time limits for controllers that cannot enforce their own.

jsctrl (QuickJS interrupt handler) and Wasm (wasmtime epochs/fuel) stop themselves at the
deadline they are given. A Python-level controller (the declarative ones) cannot be trusted
to, so on the main thread the runtime arms SIGALRM: a periodic timer (~0.5 ms) for a whole
main-channel op (`ticker`), or for one call made outside an op. Python checks signals between
bytecodes, so even `while True: pass` is interrupted with ControllerTimeout. Time spent inside
one long C call (e.g. a single llguidance mask) is only measured, not cut.

The budget counts the calling thread's CPU time (`time.thread_time`), not the wall clock: on a
machine whose cores the model's forward pass is using, the runtime can be preempted for
milliseconds, and a wall-clock limit would then fail a controller that did nothing wrong
(measured: a declarative pre_process that needs ~5 us failed its 1 ms limit that way). A
controller that loops or allocates still burns its own CPU time and is stopped.
Off the main thread (side-channel instantiate) the limit is checked when the call returns.

Python's garbage collector runs inside whichever call happens to allocate and walks the whole
process's objects, not the controller's: its CPU time, with the other gc hooks and the
finalizers it runs, is credited back to the running call (`_on_gc_start`, `_on_gc_stop`), up to
GC_CREDIT_S a call. Measured: one full collection in a process holding 3M objects took 0.4 s
inside a regex controller's pre_process and failed its 6 ms budget (a CI run of
tests/protocols/aici, in a test worker that had loaded models, failed that way; `serve` freezes
its start-up heap, heap.py). A controller's own work between collections still counts.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tokenwire.protocols.aici.controller import ControllerTimeout

T = TypeVar("T")

__all__ = ["call_with_deadline", "ticker"]

TICK_S = 0.0005  # the timer's period: budgets are enforced to within about this

_armed = False  # a controller call is running under a budget
_cpu_deadline = 0.0  # time.thread_time() of the main thread at which it runs out
_installed = False
_ticking = 0  # nesting depth of ticker() scopes
_MAIN_IDENT = threading.main_thread().ident  # signals are delivered to the main thread only
_thread_time = time.thread_time
# CPU time one tick costs the main thread (signal delivery and this handler), measured at
# install: it is credited back to the running call, so a controller is not charged for the
# timer that watches it (measured ~50 us a tick: 3.1 ms of a 30 ms sleep, more than a whole
# 2 ms pre_process budget).
_tick_cost = 0.0
_gc_started = -1.0  # thread_time() at which a collection began inside an armed call
# the most collection time one call is credited: a call that makes collections without end
# (gc.collect in a loop) still runs out (a full collection over 3M objects took 0.4 s; one in a
# test worker that had loaded models, 1.5M objects of the test's own added, ran past 0.5 s)
GC_CREDIT_S = 2.0
_gc_credit_left = GC_CREDIT_S


def _on_gc_start(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks' first hook: a collection inside an armed call starts being credited."""
    global _gc_started
    if phase == "start" and _armed and threading.get_ident() == _MAIN_IDENT:
        _gc_started = _thread_time()


def _on_gc_stop(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks' last hook: the collection's CPU time moves the deadline."""
    global _cpu_deadline, _gc_started, _gc_credit_left
    if phase == "stop" and _gc_started >= 0 and threading.get_ident() == _MAIN_IDENT:
        spent = min(_thread_time() - _gc_started, _gc_credit_left)
        _cpu_deadline += spent
        _gc_credit_left -= spent
        _gc_started = -1.0


def _hooks_around_other_callbacks() -> None:
    """Ours first and last in gc.callbacks, so every other hook (hypothesis inserts one at the
    front) and every finalizer runs inside the credited span."""
    callbacks = gc.callbacks
    if not callbacks or callbacks[0] is not _on_gc_start:
        with contextlib.suppress(ValueError):
            callbacks.remove(_on_gc_start)
        callbacks.insert(0, _on_gc_start)
    if callbacks[-1] is not _on_gc_stop:
        with contextlib.suppress(ValueError):
            callbacks.remove(_on_gc_stop)
        callbacks.append(_on_gc_stop)


_GC_HOOK_CODES = (_on_gc_start.__code__, _on_gc_stop.__code__)


def _on_alarm(signum: int, frame: Any) -> None:
    global _cpu_deadline
    if _armed:
        # never raised during a collection (in gc.callbacks or the finalizers the collector
        # runs): the exception would be unraisable, swallowed, and the collection about to be
        # credited charged; the first tick after it decides instead
        in_gc = _gc_started >= 0 or (frame is not None and frame.f_code in _GC_HOOK_CODES)
        if not in_gc and _thread_time() >= _cpu_deadline:
            raise ControllerTimeout("controller ran past its time limit (interrupted)")
        _cpu_deadline += _tick_cost


def _install() -> None:
    global _installed, _tick_cost
    if not _installed:  # signal.getsignal costs microseconds (enum lookups): remember instead
        signal.signal(signal.SIGALRM, _on_alarm)
        _installed = True
        ticks = 20
        signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
        start = _thread_time()
        time.sleep(ticks * TICK_S)
        _tick_cost = (_thread_time() - start) / ticks
        if not _ticking:
            signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def ticker() -> Iterator[None]:
    """A periodic SIGALRM for a batch of calls (one main-channel op): each call under it only
    sets its budget instead of arming and disarming a timer (two syscalls a call)."""
    global _ticking
    if threading.get_ident() != _MAIN_IDENT:
        yield
        return
    _install()
    _ticking += 1
    if _ticking == 1:
        signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    try:
        yield
    finally:
        _ticking -= 1
        if _ticking == 0:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _armed_call(fn: Callable[..., T], args: tuple[Any, ...], cpu_deadline: float) -> tuple[T, float]:
    """`fn(*args)` with the alarm armed: a tick past `cpu_deadline` raises ControllerTimeout.
    Returns the result and the deadline with the ticks' own cost credited."""
    global _armed, _cpu_deadline, _gc_started, _gc_credit_left
    _hooks_around_other_callbacks()
    _cpu_deadline, _armed, _gc_started, _gc_credit_left = cpu_deadline, True, -1.0, GC_CREDIT_S
    try:
        return fn(*args), _cpu_deadline
    finally:
        _armed = False


def call_with_deadline(
    fn: Callable[..., T],
    deadline: float,
    what: str,
    *,
    self_timed: bool,
    args: tuple[Any, ...] = (),
    remaining: float | None = None,
) -> T:
    """Run `fn(*args)` until `deadline` (time.thread_time() of this thread); raise
    ControllerTimeout when it uses more. Self-timed controllers get the deadline itself and
    stop on their own. `remaining`: the caller made `deadline` just now as
    thread_time() + remaining, so the CPU clock need not be read again to know it.

    Runs once per sequence per op: under a ticker (the common case) it only arms the budget,
    and it reads the CPU clock (a system call) only when the wall clock says the budget may
    be spent."""
    if remaining is None:
        remaining = deadline - _thread_time()
    if remaining <= 0:
        raise ControllerTimeout(f"{what}: no time left before the call started")
    if self_timed:
        return fn(*args)
    t0 = time.monotonic()
    if threading.get_ident() != _MAIN_IDENT:
        result = fn(*args)
    elif _ticking:
        result, deadline = _armed_call(fn, args, deadline)
    else:
        _install()
        signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
        try:
            result, deadline = _armed_call(fn, args, deadline)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    # CPU time never runs ahead of the wall clock
    if time.monotonic() - t0 > remaining and _thread_time() > deadline:
        raise ControllerTimeout(f"{what} ran past its time limit")
    return result
