"""Dynamic batching: concurrent requests whose inputs stack are merged into one model call.

One worker per model runs one call at a time. When it is free it takes the oldest waiting
call and every waiting call with the same batching key (input names, dtypes, trailing shapes,
outputs, config), up to `max_batch` rows; with a window > 0 it first waits up to that long
(from the oldest call's arrival) for more to join. Calls that arrive while the model is busy
form the next batch, so under load batches grow without any added latency at low load.
Merged outputs are split back by row ranges. If a merged call fails, its calls are retried
one by one so a bad request fails alone.

A lone request (the server says no other request or connection exists, so nothing could join
it) with the model free skips the queue and calls the model from its own task; a short call
(recent lone calls under `inline_max_s`) of a model that allows it runs on the loop thread.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwire.metrics import GRAPHPIPE_BATCH
from tokenwire.protocols.graphpipe.models.base import TensorModel


@dataclass
class Call:
    inputs: dict[str, np.ndarray]
    outputs: list[str]
    config: Any
    key: Hashable
    rows: int
    arrived: float = field(default_factory=time.monotonic)
    future: asyncio.Future[list[np.ndarray]] | None = None


def batch_key(model: TensorModel, inputs: dict[str, np.ndarray], outputs: list[str], config: Any) -> Hashable:
    if not model.stackable or any(a.ndim == 0 for a in inputs.values()):
        return object()  # unique: never merged
    shapes = tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in inputs.items()))
    return (shapes, tuple(outputs), config)


class Batcher:
    def __init__(
        self, model: TensorModel, *, window_s: float = 0.0, max_batch: int = 64, inline_max_s: float = 0.0
    ) -> None:
        self.model = model
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self.inline_max_s = inline_max_s
        self.model_calls = 0  # calls into the model (a merged batch counts once)
        self.requests = 0  # calls submitted
        self.largest_batch = 0
        self.inline_calls = 0  # of model_calls, those run on the event loop thread
        self._waiting: deque[Call] = deque()
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._busy = False  # a model call is running (the worker's or a direct one)
        self._lone_call_s = math.inf  # recent duration of a lone request's call (smoothed)
        self._batch_sizes = GRAPHPIPE_BATCH.labels(model.name)  # rows per model call (Prometheus)

    async def submit(
        self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any, *, alone: bool = False
    ) -> list[np.ndarray]:
        """The outputs for one request. `alone`: the server has no other request in flight and
        no other client connection, so no batch can form: the call goes straight to the model
        (and a short one may run on the event loop thread itself, see _run_direct)."""
        first_input = next(iter(inputs.values()), None)
        rows = first_input.shape[0] if first_input is not None and first_input.ndim else 1
        self.requests += 1
        if alone and not self._busy and not self._waiting and self.window_s <= 0:
            return await self._run_direct(inputs, outputs, config, rows)
        key = batch_key(self.model, inputs, outputs, config)
        call = Call(inputs, outputs, config, key, rows, future=asyncio.get_running_loop().create_future())
        self._waiting.append(call)
        self._kick()
        assert call.future is not None
        return await call.future

    def _kick(self) -> None:
        self._wake.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name=f"graphpipe-batcher-{self.model.name}")

    def _count_call(self, rows: int) -> None:
        self.model_calls += 1
        self.largest_batch = max(self.largest_batch, rows)
        self._batch_sizes.observe(rows)

    async def _run_direct(
        self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any, rows: int
    ) -> list[np.ndarray]:
        """A lone request and a free model: call it from the request's own task, without the
        hand-over to the worker and back (two event loop turns). Requests that arrive
        meanwhile queue for the worker, which starts once this call is done."""
        self._busy = True
        self._count_call(rows)
        run_inline = self.model.run_inline
        if run_inline is not None and self._lone_call_s < self.inline_max_s:
            # A short call and no other client to serve meanwhile: run it on this thread.
            # Handing it to a pool thread and back costs two thread wake-ups (~0.2 ms here)
            # and gains nothing when the loop has nothing else to do for GraphPipe.
            self.inline_calls += 1
            began = time.perf_counter()
            try:
                return run_inline(inputs, outputs, config)
            finally:
                self._note_lone_call(time.perf_counter() - began)
                self._call_done()
        began = time.perf_counter()
        try:
            future = self.model.start(inputs, outputs, config)
        except BaseException:
            self._call_done()
            raise
        # the call's end (not this request's, which may be cancelled) frees the model
        future.add_done_callback(lambda _: self._call_done(time.perf_counter() - began))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.cancel()  # its only caller went away: the model stops what it can
            raise

    def _note_lone_call(self, seconds: float) -> None:
        last = self._lone_call_s
        self._lone_call_s = seconds if last == math.inf else 0.8 * last + 0.2 * seconds

    def _call_done(self, lone_call_s: float | None = None) -> None:
        if lone_call_s is not None:
            self._note_lone_call(lone_call_s)
        self._busy = False
        if self._waiting:
            self._kick()

    async def _work(self) -> None:
        while True:
            if not self._waiting or self._busy:  # nothing to do, or a direct call runs
                self._wake.clear()
                await self._wake.wait()
                continue
            first = self._waiting[0]
            if self.window_s > 0:
                await self._wait_window(first)
            group = self._take_group(first)
            self._busy = True
            try:
                await self._run(group)
            finally:
                self._busy = False

    async def _wait_window(self, first: Call) -> None:
        while True:
            if sum(c.rows for c in self._waiting if c.key == first.key) >= self.max_batch:
                return
            left = first.arrived + self.window_s - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take_group(self, first: Call) -> list[Call]:
        group, rest, rows = [], deque(), 0
        while self._waiting:
            call = self._waiting.popleft()
            fits = call.key == first.key and (not group or rows + call.rows <= self.max_batch)
            if call is first or fits:
                group.append(call)
                rows += call.rows
            else:
                rest.append(call)
        self._waiting = rest
        return group

    async def _run(self, group: list[Call]) -> None:
        live = [c for c in group if c.future is not None and not c.future.done()]
        if not live:
            return
        if len(live) == 1:
            await self._run_one(live[0])
            return
        merged = {name: np.concatenate([c.inputs[name] for c in live]) for name in live[0].inputs}
        self._count_call(sum(c.rows for c in live))
        try:
            results = await self._call_for(live, merged)
            if results is None:
                return
            total = sum(c.rows for c in live)
            if any(r.ndim == 0 or r.shape[0] != total for r in results):
                raise ValueError("an output has no batch dimension")
        except Exception:
            for call in live:  # one by one, so only the request that breaks the model fails
                await self._run_one(call)
            return
        start = 0
        for call in live:
            end = start + call.rows
            assert call.future is not None
            if not call.future.done():
                call.future.set_result([r[start:end] for r in results])
            start = end

    async def _run_one(self, call: Call) -> None:
        assert call.future is not None
        self._count_call(call.rows)
        try:
            result = await self._call_for([call], call.inputs)
            if result is None:
                return
        except Exception as exc:
            if not call.future.done():
                call.future.set_exception(exc)
            return
        if not call.future.done():
            call.future.set_result(result)

    async def _call_for(self, calls: list[Call], inputs: dict[str, np.ndarray]) -> list[np.ndarray] | None:
        """The model's outputs for `calls` (stacked in `inputs`), or None when every caller went
        away first: the model call is then cancelled (the engine's LM stops before its next
        layer) rather than left to hold the model for a result nobody reads."""
        started = self.model.start(inputs, calls[0].outputs, calls[0].config)

        def abandon(_: Any) -> None:
            if all(c.future is not None and c.future.cancelled() for c in calls):
                started.cancel()

        for call in calls:
            assert call.future is not None
            call.future.add_done_callback(abandon)
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started.cancelled() and (task is None or not task.cancelling()):
                return None  # abandoned by its callers; this worker goes on
            started.cancel()
            raise

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        for call in self._waiting:
            if call.future is not None and not call.future.done():
                call.future.cancel()
        self._waiting.clear()
