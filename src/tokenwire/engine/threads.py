"""How many CPU threads the engine's kernels use: the CPUs this process may actually run on.

`os.cpu_count()` counts the machine; a container or `taskset` may allow fewer. The choice, in
order: `--threads` (EngineSettings.threads), `$TOKENWIRE_THREADS`, else the CPUs in the affinity
mask (`os.sched_getaffinity`) capped by the cgroup v2 CPU quota (`cpu.max` of this process's
cgroup and its ancestors, rounded up). More threads than usable CPUs make every barrier of the
fused decode step wait for a thread that is not running (docs/engine.md, "Sharing the machine").
The choice is logged once at start and exported as the `tokenwire_engine_threads` gauge.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tokenwire.threads")

ENV = "TOKENWIRE_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # "flag", "env", "affinity" or "cgroup"
    why: str


_current: ThreadChoice | None = None


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest cgroup v2 CPU quota over this process's cgroup and its ancestors, in CPUs
    (`cpu.max` = "QUOTA PERIOD" or "max PERIOD"); None where there is none or no cgroup v2."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None
    limit: float | None = None
    node = root / rel.strip("/")
    while True:
        try:
            quota, period = (node / "cpu.max").read_text().split()[:2]
            if quota != "max" and int(period) > 0:
                cpus = int(quota) / int(period)
                limit = cpus if limit is None else min(limit, cpus)
        except (OSError, ValueError):
            pass
        if node == root or root not in node.parents:
            return limit
        node = node.parent


def choose_threads(requested: int | None = None) -> ThreadChoice:
    if requested is not None and requested > 0:
        return ThreadChoice(requested, "flag", f"--threads {requested}")
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"${ENV}={env!r}: expected a positive whole number of threads")
        return ThreadChoice(value, "env", f"${ENV}={value}")
    cpus = affinity_cpus()
    quota = cgroup_cpu_limit()
    if quota is not None and math.ceil(quota) < cpus:
        n = max(1, math.ceil(quota))
        return ThreadChoice(n, "cgroup", f"cgroup CPU quota {quota:g} CPUs, {cpus} CPUs in the affinity mask")
    limit = f"cgroup CPU quota {quota:g} CPUs" if quota is not None else "no cgroup CPU quota"
    return ThreadChoice(cpus, "affinity", f"{cpus} CPUs in the affinity mask, {limit}")


def apply_threads(requested: int | None = None) -> ThreadChoice:
    """Choose, set torch's thread count (intra-op, OpenMP) and log the choice in one line."""
    # local: torch; `serve --help` loads this module (metrics.py reports its choice) without it
    import torch

    global _current
    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    _current = choice
    log.info("engine threads: %d (%s; machine has %s CPUs)", choice.threads, choice.why, os.cpu_count())
    return choice


def current() -> ThreadChoice | None:
    """The last choice apply_threads made (None before any engine was built)."""
    return _current
