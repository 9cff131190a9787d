"""Per-call time limits for controllers that cannot enforce their own.

jsctrl (QuickJS interrupt handler) and Wasm (wasmtime epochs/fuel) stop themselves at the
deadline they are given. A Python-level controller (the declarative ones) cannot be trusted
to, so on the main thread the runtime arms a one-shot SIGALRM timer: Python checks signals
between bytecodes, so even `while True: pass` is interrupted with ControllerTimeout. Time
spent inside one long C call (e.g. a single llguidance mask) is only measured, not cut.
Off the main thread (side-channel instantiate) the limit is checked when the call returns.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tokenwire.protocols.aici.controller import ControllerTimeout

T = TypeVar("T")

__all__ = ["call_with_deadline"]

_armed = False


def _on_alarm(signum: int, frame: Any) -> None:
    if _armed:
        raise ControllerTimeout("controller ran past its time limit (interrupted)")


def call_with_deadline(fn: Callable[[], T], deadline: float, what: str, *, self_timed: bool) -> T:
    """Run `fn`; raise ControllerTimeout when it runs past `deadline` (time.monotonic())."""
    global _armed
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ControllerTimeout(f"{what}: no time left before the call started")
    use_alarm = not self_timed and threading.current_thread() is threading.main_thread()
    if use_alarm:
        if signal.getsignal(signal.SIGALRM) is not _on_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)
        _armed = True
        signal.setitimer(signal.ITIMER_REAL, remaining)
    try:
        result = fn()
    finally:
        if use_alarm:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    if not self_timed and time.monotonic() > deadline:
        raise ControllerTimeout(f"{what} ran past its time limit")
    return result
