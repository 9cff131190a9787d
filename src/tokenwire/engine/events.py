"""Moving request events off the thread that makes them (the engine's model thread, a replica
pump) to the consumers that read them.

Two pieces, one job each:

- `EventFeed`: one request's events to its one subscriber, called on the producing thread. Events
  made before anyone subscribed are parked and handed over first, so a caller may subscribe after
  `generate` returned without losing the early ones.
- `EventChannel`: items pushed from any thread, delivered to one asyncio loop in batches. The
  producer wakes the loop (`call_soon_threadsafe`: a write to the loop's self-pipe) only when the
  consumer is parked waiting, once per wait; items pushed while the consumer is busy (writing the
  previous chunk to its socket) or while a wake-up is on its way just queue, and the consumer's
  next `get()` takes them all without waiting. Everything one engine step produced crosses
  threads together (a prefill burst of many logprob positions, every stream of an LMTP
  connection), which is what lets a protocol write one frame per step instead of one per event.

  Why gate the wake-up on a waiting consumer (issue 43): each wake-up costs the model thread a
  self-pipe write, during which it lets go of the GIL, and costs the loop an iteration that takes
  the GIL back (py-spy: ~3.6% of the model thread in `_write_to_self`). Before, a push after the
  consumer had taken its batch always scheduled one, even while the consumer was still busy and
  would come back for the items by itself; that wake-up then found nobody waiting.
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
    """Items from any thread to one asyncio loop, in push order, one loop wake-up per wait.

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
        # the consumer is parked, and no wake-up is on its way yet: the next push sends one. An
        # on_batch consumer is always ready for the next batch; a get() consumer parks in get().
        self._waiting = on_batch is not None
        self._closed = False
        self._ready = asyncio.Event()

    def push(self, item: T) -> None:
        """Any thread: queue the item; wake the loop if the consumer is parked waiting for it."""
        self.push_all((item,))

    def push_all(self, items: Iterable[T]) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending.extend(items)
            if not self._waiting or not self._pending:
                return  # the consumer is busy and comes back for these, or a wake-up is on its way
            self._waiting = False
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
        """What was pushed since the last take (maybe nothing), without waiting. An on_batch
        consumer is ready again once it took: the next push wakes the loop."""
        with self._lock:
            batch, self._pending = self._pending, []
            if self._on_batch is not None and not self._closed:
                self._waiting = True
        return batch

    async def get(self) -> list[T]:
        """The next non-empty batch: what is queued now, else what the first push brings; [] once
        the channel is closed and drained."""
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if batch or self._closed:
                    return batch
                self._waiting = True  # parked: the next push (or close) wakes the loop
            # clear before waiting: a set left from an earlier, abandoned wait must not count.
            # No wake-up can run in between: it runs on this loop, which runs nothing until we wait.
            self._ready.clear()
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
            waiting, self._waiting = self._waiting, False
        if waiting:
            self._schedule()
