"""Moving request events off the thread that makes them (the engine's model thread, a replica
pump) to the consumers that read them.

Two pieces, one job each:

- `EventFeed`: one request's events to its one subscriber, called on the producing thread. Events
  made before anyone subscribed are parked and handed over first, so a caller may subscribe after
  `generate` returned without losing the early ones.
- `EventChannel`: items pushed from any thread, delivered to one asyncio loop in batches, with one
  `call_soon_threadsafe` per batch. Everything one engine step produced crosses threads together
  (a prefill burst of many logprob positions, every stream of an LMTP connection), which is what
  lets a protocol write one frame per step instead of one per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class EventFeed(Generic[T]):
    """One producer's events to one subscriber, in order, on the producer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: list[T] = []
        self._sink: Callable[[T], None] | None = None

    def push(self, event: T) -> None:
        self.push_all((event,))

    def push_all(self, events: Iterable[T]) -> None:
        # the sink runs under the lock: a subscribe racing a push must not let a new event
        # overtake the parked ones it is still handing over
        with self._lock:
            if self._sink is None:
                self._parked.extend(events)
                return
            for event in events:
                self._sink(event)

    def subscribe(self, sink: Callable[[T], None]) -> None:
        """Call sink(event) for every event, the parked ones first (on this thread), then each
        new one on the producer's thread. The sink must be quick and must not raise: it runs
        with the producer's locks held (the engine lock, for the model thread)."""
        with self._lock:
            if self._sink is not None:
                raise RuntimeError("this request's events already have a subscriber")
            parked, self._parked = self._parked, []
            for event in parked:
                sink(event)
            self._sink = sink


class EventChannel(Generic[T]):
    """Items from any thread to one asyncio loop, in push order, one loop wake-up per batch.

    Consume either with `on_batch` (called on the loop with each batch) or by awaiting `get()` /
    iterating `async for batch in channel` (not both). `close()` drops later pushes and ends the
    iteration once what was pushed before is delivered."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        on_batch: Callable[[list[T]], None] | None = None,
    ) -> None:
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self._on_batch = on_batch
        self._lock = threading.Lock()
        self._pending: list[T] = []
        self._scheduled = False  # a wake-up is on its way to the loop: later pushes ride along
        self._closed = False
        self._ready = asyncio.Event()

    def push(self, item: T) -> None:
        """Any thread: queue the item; the first push of a batch schedules the loop's wake-up."""
        self.push_all((item,))

    def push_all(self, items: Iterable[T]) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending.extend(items)
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        self._schedule()

    def _schedule(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """On the loop."""
        if self._on_batch is None:
            self._ready.set()
            return
        batch = self.take()
        if batch:
            self._on_batch(batch)

    def take(self) -> list[T]:
        """What was pushed since the last take (maybe nothing), without waiting."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        return batch

    async def get(self) -> list[T]:
        """The next non-empty batch; [] once the channel is closed and drained."""
        while True:
            self._ready.clear()
            batch = self.take()
            if batch or self._closed:
                return batch
            await self._ready.wait()

    async def __aiter__(self) -> AsyncIterator[list[T]]:
        while batch := await self.get():
            yield batch

    def close(self) -> None:
        """Any thread: push nothing more; a waiting `get()` returns what is left, then []."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._schedule()
