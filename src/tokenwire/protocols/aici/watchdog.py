"""The runtime's last line of defence: a CPU-time timer on the main thread that kills the process.

Controllers stop themselves at their deadlines (QuickJS interrupt handler, wasmtime fuel and
epochs, SIGALRM for Python code), except inside native code that never checks: QuickJS's regex
engine (`/^(a+)+$/.test("a".repeat(40) + "b")` ran for good: the bundled QuickJS 2021-03-27
never calls the interrupt handler from lre_exec, measured: 27 a's took 5.6 s CPU under a 0.5 s
limit) or one enormous host call. Such a call holds the GIL, so no Python thread can act.

A POSIX timer on the main thread's CPU clock (`timer_create(pthread_getcpuclockid)`) is armed
around every controller call for twice its budget plus GRACE_S (past the Wasm epoch backstop,
twice the budget plus 10 ms of wall time, so wasmtime interrupts first); it delivers SIGXCPU,
whose default action ends the process (no handler: a Python handler would wait for the stuck
call). The engine's supervisor sees the exit, fails the runs in flight and starts a fresh runtime.
Per-thread CPU time: side-channel threads and preemption do not count. Arming costs ~2 us
(measured, 1000 timer_settime calls in 2 ms).
"""

from __future__ import annotations

import ctypes
import logging
import resource
import signal
import threading
import time

log = logging.getLogger("tokenwire.aicirt")

# CPU seconds past a call's own budget before the process is killed: far above any deadline a
# well-behaved controller needs (they stop within ~1 ms of theirs), short enough that the
# supervisor has a new runtime within seconds
GRACE_S = 1.0
_SIGEV_SIGNAL = 0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):  # glibc's struct sigevent is 64 bytes
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("_pad", ctypes.c_byte * 48),
    ]


class CpuWatchdog:
    """A kill timer on the CPU clock of the thread that makes it (the runtime's main thread)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        clock = time.pthread_getcpuclockid(threading.get_ident())
        event = _Sigevent(None, signal.SIGXCPU, _SIGEV_SIGNAL)
        self._timer = ctypes.c_void_p()
        if self._libc.timer_create(clock, ctypes.byref(event), ctypes.byref(self._timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        try:  # SIGXCPU dumps core by default: a killed runtime must not leave a core file
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ValueError, OSError):
            pass
        self._off = _Itimerspec()

    def arm(self, budget_s: float) -> None:
        total = 2 * max(0.0, budget_s) + GRACE_S
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(total), int((total % 1) * 1e9)))
        self._libc.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def disarm(self) -> None:
        self._libc.timer_settime(self._timer, 0, ctypes.byref(self._off), None)


class NoWatchdog:
    """In-process runtimes (tests, benchmarks) are not killed."""

    def arm(self, budget_s: float) -> None:
        pass

    def disarm(self) -> None:
        pass


def install() -> CpuWatchdog | NoWatchdog:
    """The watchdog of the calling (main) thread, or a no-op one where POSIX timers are missing."""
    try:
        return CpuWatchdog()
    except (OSError, AttributeError) as e:
        log.warning("no CPU watchdog (%s): a controller stuck in native code can hang the runtime", e)
        return NoWatchdog()
