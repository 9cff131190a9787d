"""How long the model thread holds the engine lock in each step: while it does, every public
call (generate, cancel, stats, a stream's next event) waits. `tokenwire bench spec --lock-hold`
reports it (bench/lock_hold_bench.py)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepHolds:
    """One step's holds of the engine lock by the model thread, in seconds."""

    schedule: float  # from taking the lock to schedule()'s items (admission, packing, guesses)
    postprocess: float  # the step's outcomes delivered (sampling, events, finishes)
    other: float = 0.0  # any other hold of the step (the draft model's planning)

    @property
    def total(self) -> float:
        return self.schedule + self.postprocess + self.other


class LockHolds:
    """The last `keep` steps' holds. Written by the model thread only; a reader copies."""

    def __init__(self, keep: int = 8192) -> None:
        self.steps: deque[StepHolds] = deque(maxlen=keep)

    def add(self, schedule: float, postprocess: float, other: float = 0.0) -> None:
        self.steps.append(StepHolds(schedule, postprocess, other))

    def clear(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, float]:
        """Median and p99 (ms) of each part and of the total per step, and the step count."""
        steps = list(self.steps)
        out: dict[str, float] = {"steps": float(len(steps))}
        if not steps:
            return out
        for name in ("schedule", "postprocess", "total"):
            values = sorted(getattr(s, name) * 1e3 for s in steps)
            out[f"{name}_median_ms"] = statistics.median(values)
            out[f"{name}_p99_ms"] = values[min(len(values) - 1, int(0.99 * len(values)))]
        return out


def now() -> float:
    return time.perf_counter()
