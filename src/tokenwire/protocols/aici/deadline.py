"""Per-call time limits for controllers that cannot enforce their own.

jsctrl (QuickJS interrupt handler) and Wasm (wasmtime epochs/fuel) stop themselves at the
deadline they are given. A Python-level controller (the declarative ones) cannot be trusted
to, so on the main thread the runtime arms SIGALRM: a one-shot timer per call, or for a whole
main-channel op one periodic timer (`ticker`, ~0.5 ms resolution). Python checks signals
between bytecodes, so even `while True: pass` is interrupted with ControllerTimeout. Time
spent inside one long C call (e.g. a single llguidance mask) is only measured, not cut.
Off the main thread (side-channel instantiate) the limit is checked when the call returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tokenwire.protocols.aici.controller import ControllerTimeout

T = TypeVar("T")

__all__ = ["call_armed", "call_with_deadline", "ticker", "ticking"]

TICK_S = 0.0005  # the ticker's period: deadlines are enforced to within about this

_armed = False  # a controller call is running under a deadline
_deadline = 0.0
_installed = False
_ticking = 0  # nesting depth of ticker() scopes
_MAIN_IDENT = threading.main_thread().ident  # signals are delivered to the main thread only


def _on_alarm(signum: int, frame: Any) -> None:
    if _armed and (not _ticking or time.monotonic() >= _deadline):
        raise ControllerTimeout("controller ran past its time limit (interrupted)")


def _install() -> None:
    global _installed
    if not _installed:  # signal.getsignal costs microseconds (enum lookups): remember instead
        signal.signal(signal.SIGALRM, _on_alarm)
        _installed = True


@contextlib.contextmanager
def ticker() -> Iterator[None]:
    """A periodic SIGALRM for a batch of calls (one main-channel op): each call under it only
    sets its deadline instead of arming and disarming a one-shot timer (two syscalls a call)."""
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


def ticking() -> bool:
    """True on the main thread inside a ticker(): calls may use `call_armed`."""
    return _ticking > 0 and threading.get_ident() == _MAIN_IDENT


def call_armed(fn: Callable[..., T], args: tuple[Any, ...], deadline: float) -> T:
    """Under a ticker on the main thread: `fn(*args)`, interrupted once it runs past `deadline`
    (the ticker's alarm raises ControllerTimeout). The caller checks the time afterwards."""
    global _armed, _deadline
    _deadline, _armed = deadline, True
    try:
        return fn(*args)
    finally:
        _armed = False


def call_with_deadline(
    fn: Callable[..., T], deadline: float, what: str, *, self_timed: bool, args: tuple[Any, ...] = ()
) -> T:
    """Run `fn(*args)`; raise ControllerTimeout when it runs past `deadline` (time.monotonic()).

    The common case (main thread, under a ticker) only sets two globals around the call: it
    runs once per sequence per op, so its cost is multiplied by the batch size."""
    global _armed, _deadline
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ControllerTimeout(f"{what}: no time left before the call started")
    if self_timed or threading.get_ident() != _MAIN_IDENT:
        result = fn(*args)
    elif _ticking:
        _deadline, _armed = deadline, True
        try:
            result = fn(*args)
        finally:
            _armed = False
    else:
        _install()
        _deadline, _armed = deadline, True
        signal.setitimer(signal.ITIMER_REAL, remaining)
        try:
            result = fn(*args)
        finally:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    if not self_timed and time.monotonic() > deadline:
        raise ControllerTimeout(f"{what} ran past its time limit")
    return result
