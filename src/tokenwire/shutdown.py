"""SIGINT/SIGTERM for `tokenwire serve`: a graceful stop within --shutdown-grace, and a hard
deadline that ends the process when the graceful stop cannot finish in time.

The signals go to `signal.signal`'s handler, not asyncio's `add_signal_handler`: asyncio runs its
handler from the event loop, so a loop held by one request's work (issue 29: a 1 KB Evergreen
message that flattened to 2^30 chunks held it for minutes) never saw SIGTERM, and the server
needed SIGKILL. The signal module's handler runs in the main thread between two bytecodes, held
loop or not; it starts the hard deadline on a thread of its own and then asks the loop to stop.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

log = logging.getLogger("tokenwire.server")

# The interpreter's own exit (thread joins, atexit, log flush) after the graceful stop returns:
# measured 0.1-0.4 s on this machine. The graceful steps get the grace less this much.
EXIT_MARGIN_S = 0.75


class ShutdownSignals:
    """Catches SIGINT/SIGTERM: the first sets `stop` (from the loop's thread) and arms the hard
    deadline `grace_s` seconds later; a second one ends the process at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event, grace_s: float) -> None:
        self.loop = loop
        self.stop = stop
        self.grace_s = grace_s
        self.received_at: float | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def graceful_deadline(self) -> float:
        """The monotonic time by which the graceful steps must be done."""
        start = self.received_at if self.received_at is not None else time.monotonic()
        return start + max(0.1, self.grace_s - EXIT_MARGIN_S)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received_at is not None:
            _exit_now(f"second {name} during shutdown: exiting now")
        self.received_at = time.monotonic()
        threading.Thread(target=self._hard_deadline, name="shutdown-deadline", daemon=True).start()
        self.loop.call_soon_threadsafe(self.stop.set)

    def _hard_deadline(self) -> None:
        time.sleep(self.grace_s)
        _exit_now(f"the graceful stop did not finish within --shutdown-grace {self.grace_s:g}s; exiting now")


def _exit_now(reason: str) -> None:
    """Log why (with every thread's stack, to find what held the stop), flush, and end the
    process with status 1 without running anything else."""
    log.error(reason)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError, RuntimeError):  # stderr closed or not a real file
        pass
    _flush_logs()
    os._exit(1)


def _flush_logs() -> None:
    """Every log line written so far reaches its file before os._exit skips the flush."""
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:  # a broken handler must not keep the process alive
            pass


def exit_leaving_model_thread() -> None:
    """End the process (status 0: the graceful stop is done) while the model thread is still in
    a step: the interpreter's normal exit tears down torch's and the kernels' state under it and
    the process aborts ("terminate called without an active exception", SIGABRT)."""
    log.warning("exiting with the model thread still in its step")
    _flush_logs()
    os._exit(0)
