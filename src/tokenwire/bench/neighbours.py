"""Busy neighbours for the benchmarks' `--neighbours N`: N `nice -n 19` Python busy loops.

Each loop starts in a session of its own (setsid), as a cron job, a monitoring agent or a loop
typed into another terminal would be. That matters on Linux with autogroup scheduling
(`/proc/sys/kernel/sched_autogroup_enabled` = 1, the default on desktop kernels and on this
machine): nice ranks threads only within one session's group, and groups share the CPUs
equally, so a `nice 19` loop in another session takes a core from us as often as a normal
process would. Started in the benchmark's own session (`own_session=False`) the same loop is
nearly idle-priority to us. docs/engine.md ("Sharing the machine") has both measured.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOOP = "while True: pass"


def autogroup_enabled() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


@contextmanager
def busy_neighbours(n: int, own_session: bool = True) -> Iterator[list[subprocess.Popen[bytes]]]:
    """N nice-19 busy loops for the duration of the block (none when n is 0)."""
    procs = [
        subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", LOOP], start_new_session=own_session)
        for _ in range(n)
    ]
    try:
        if procs:
            time.sleep(0.2)  # running (and spread over the CPUs) before the measure starts
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def describe(n: int, own_session: bool = True) -> str:
    where = "each in its own session" if own_session else "in the benchmark's session"
    group = " (autogroup scheduling on)" if autogroup_enabled() else ""
    return f"{n} nice-19 busy loop{'s' if n != 1 else ''}, {where}{group}"
