"""How many threads the decoder layers of a step outside the fused kernel get: all of them, or
one while the cores are contended.

The steps of a model the fused stack does not run (a mixture of experts, post-norms, M-RoPE...,
or --no-compile) run torch's layers, attention and our qmatmul, each an OpenMP region that ends
at a barrier. When another process holds one of our cores (with
autogroup scheduling a `nice 19` loop in another session weighs as much as our whole server),
every such barrier waits out the partner's time slice. Measured on this 2-core machine
(SmolLM2-135M, two busy loops in another session, docs/engine.md "Sharing the machine"): a
1,000-token prefill fell from 636 to 90 tok/s on two threads and ran at 224 on one; quiet, the
process used 97-100 % of its two threads' time, contended 32-33 %.

That share is the signal: the team's CPU time missing from threads x wall is time its threads
were not running (preempted, or asleep at a barrier for a partner that was). The decision is the
fused stack's TeamGate (kernels/barrier.h), a second instance: two contended layers in a row
start a span of one-thread layers, then a team layer probes and keeps the team only if it is
faster per row. It is taken per decoder layer, not per step: a prefill step is two or three
chunks of 512 rows, each 0.8-5 s, too few and too long to learn from (measured: deciding per
step left the prefill at 96 tok/s). Steps of fewer than MIN_ROWS rows follow the gate but do not
report: their OpenMP regions are too short to keep two threads busy even on a quiet machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenwire.model import kernels
from tokenwire.model.layers.block import DecoderLayer

MIN_ROWS = 64


class StepTeam:
    """Sizes the thread team of each decoder layer of an unfused step, on the model thread."""

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled and kernels.loaded()
        self.full = 0  # the model thread's thread count, read at its first step
        self._rows = 0  # rows of the step under way; 0 outside step()
        self._team = 0
        self._cpu = self._wall = 0
        if self.enabled:  # a model without decoder layers (RandomTokenModel) has nothing to size
            for layer in model.modules():
                if isinstance(layer, DecoderLayer):
                    layer.register_forward_pre_hook(self._before)
                    layer.register_forward_hook(self._after)

    @contextmanager
    def step(self, rows: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if not self.full:
            self.full = torch.get_num_threads()
        self._rows = rows
        try:
            yield
        finally:
            self._rows = 0
            if torch.get_num_threads() != self.full:  # a layer that raised left its team
                torch.set_num_threads(self.full)

    def _before(self, _module: Any, _args: Any) -> None:
        if not self._rows:  # fused decode steps and direct model calls size their own teams
            return
        self._team = int(kernels.ops().step_team(self.full))
        if torch.get_num_threads() != self._team:
            torch.set_num_threads(self._team)
        self._cpu, self._wall = time.process_time_ns(), time.perf_counter_ns()

    def _after(self, _module: Any, _args: Any, _output: Any) -> None:
        if self._rows < MIN_ROWS:  # outside a step too (0 rows)
            return
        elapsed = time.perf_counter_ns() - self._wall
        waited = max(0, self._team * elapsed - (time.process_time_ns() - self._cpu))
        kernels.ops().step_team_report(waited, self._team, self.full, elapsed, self._rows)
