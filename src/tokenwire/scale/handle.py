"""The front-end's end of a request running on a replica: the RequestHandle interface, fed by the
facade's per-replica event pump (facade.py) instead of the engine's model thread.

Events arrive in batches (one per engine step) as the replica produces them. If the replica dies
mid-stream, the stream ends with FinishEvent(reason="error", unavailable=True) naming the lost
replica. `cancel` sends the replica's `cancel` at once (an actor call beside the event stream).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from tokenwire.engine.request import Event, FinishEvent, TokenEvent

LOST_ERRORS: tuple[type[BaseException], ...] = ()  # ray's actor-death errors, set on first use


def _lost_errors() -> tuple[type[BaseException], ...]:
    global LOST_ERRORS
    if not LOST_ERRORS:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        LOST_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
    return LOST_ERRORS


def lost_event(replica: int, exc: BaseException) -> FinishEvent:
    return FinishEvent(
        "error", 0, 0,
        error=f"engine replica {replica} was lost mid-request ({type(exc).__name__}); "
        "its sessions are gone, open a new one",
        unavailable=True,
    )  # fmt: skip


class RemoteHandle:
    def __init__(
        self,
        replica: int,
        actor: Any,
        key: str,
        on_end: Callable[[RemoteHandle, FinishEvent, BaseException | None], None],
    ) -> None:
        self.replica = replica
        self.key = key
        self._actor = actor
        self._on_end = on_end
        self._session_id = ""
        self._cached = 0
        self.finished = False
        self.load = 0.0  # what the router counted for it
        self.origin: Any = None
        self.ephemeral = False  # started without a session (the replica made a one-request one)
        self.arrived = time.monotonic()
        self.token_times: list[float] = []  # when each generated token reached this process
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]] | None = None
        self._sink: Callable[[Event], None] | None = None

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def cached_tokens(self) -> int:
        return self._cached

    def started(self, session_id: str, cached_tokens: int) -> None:
        self._session_id, self._cached = session_id, cached_tokens

    def cancel(self) -> None:
        if not self.finished:
            self._actor.cancel.remote(self.key)  # fire and forget: it runs beside the stream

    def queue_position(self) -> int | None:
        """Not known across the hop (LMTP's queue announcements are off with --replicas)."""
        return None

    # ------------------------------------------------------------------ delivery (pump thread)
    def deliver(self, cached_tokens: int, events: list[Event]) -> None:
        self._cached = cached_tokens
        now = time.monotonic()
        self.token_times.extend(now for e in events if isinstance(e, TokenEvent) and not e.is_prefill)
        if events and isinstance(events[-1], FinishEvent):
            self._end(events[-1], None)  # first: a client that saw its end finds it counted
        self._emit(events)

    def fail(self, exc: BaseException) -> None:
        """The replica died with the request unfinished."""
        if self.finished:
            return
        event = lost_event(self.replica, exc)
        self._end(event, exc)
        self._emit([event])

    def _end(self, event: FinishEvent, exc: BaseException | None) -> None:
        if not self.finished:
            self.finished = True
            self._on_end(self, event, exc)

    def _emit(self, events: list[Event]) -> None:
        with self._lock:
            if self._sink is not None:
                for event in events:
                    self._sink(event)
                return
            if self._async is None:
                for event in events:
                    self._queue.put(event)
                return
            loop, q = self._async
        try:  # one wake-up of the consumer's loop per batch
            loop.call_soon_threadsafe(_put_all, q, events)
        except RuntimeError:
            pass  # the consumer's loop is closed; nobody is listening

    # ------------------------------------------------------------------ consuming
    async def __aiter__(self) -> AsyncIterator[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            while True:  # events delivered before the consumer attached
                try:
                    q.put_nowait(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._async = (asyncio.get_running_loop(), q)
        try:
            while True:
                event = await q.get()
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            if not self.finished:
                self.cancel()  # the consumer went away (client disconnect)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._queue.get()
            yield event
            if isinstance(event, FinishEvent):
                return

    def subscribe(self, sink: Callable[[Event], None]) -> None:
        """Deliver events by calling sink(event) on the facade's pump thread (as the engine
        calls it on its model thread), in order; events delivered before are passed on first."""
        with self._lock:
            while True:
                try:
                    sink(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    def result(self) -> tuple[list[TokenEvent], FinishEvent]:
        tokens: list[TokenEvent] = []
        for event in self:
            if isinstance(event, FinishEvent):
                return tokens, event
            tokens.append(event)  # type: ignore[arg-type]
        raise AssertionError("stream ended without a FinishEvent")


def _put_all(q: asyncio.Queue[Event], events: list[Event]) -> None:
    for event in events:
        q.put_nowait(event)
