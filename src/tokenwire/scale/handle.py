"""The front-end's end of a request running on a replica: the RequestHandle interface over a
Ray streaming generator.

Events arrive in batches (one per engine step) as the replica produces them. If the replica dies
mid-stream, the stream ends with FinishEvent(reason="error", unavailable=True) naming the lost
replica, and the facade is told so it stops placing sessions there. `cancel` sends the replica's
`cancel` at once (a separate actor call, not queued behind the stream).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from tokenwire.engine.request import Event, FinishEvent, TokenEvent

LOST_ERRORS: tuple[type[BaseException], ...] = ()  # ray's actor-death errors, set on first use


def _lost_errors() -> tuple[type[BaseException], ...]:
    global LOST_ERRORS
    if not LOST_ERRORS:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        LOST_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
    return LOST_ERRORS


class RemoteHandle:
    def __init__(
        self,
        replica: int,
        actor: Any,
        key: str,
        stream: Any,  # ray ObjectRefGenerator, its first item already read
        session_id: str,
        cached_tokens: int,
        on_end: Callable[[RemoteHandle, FinishEvent, BaseException | None], None],
    ) -> None:
        self.replica = replica
        self._actor = actor
        self._key = key
        self._stream = stream
        self._session_id = session_id
        self._cached = cached_tokens
        self._on_end = on_end
        self.finished = False
        self.prompt_tokens = 0

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def cached_tokens(self) -> int:
        return self._cached

    def cancel(self) -> None:
        if not self.finished:
            self._actor.cancel.remote(self._key)  # fire and forget: it runs beside the stream

    def queue_position(self) -> int | None:
        """Not known across the hop (LMTP's queue announcements are off with --replicas)."""
        return None

    # ------------------------------------------------------------------ consuming
    def _lost(self, exc: BaseException) -> FinishEvent:
        return FinishEvent(
            "error", 0, 0,
            error=f"engine replica {self.replica} was lost mid-request ({type(exc).__name__}); "
            "its sessions are gone, open a new one",
            unavailable=True,
        )  # fmt: skip

    def _accept(self, item: tuple[str, int, list[Event]]) -> list[Event]:
        _, self._cached, events = item
        if events and isinstance(events[-1], FinishEvent):
            self._end(events[-1], None)
        return events

    def _end(self, event: FinishEvent, exc: BaseException | None) -> None:
        if not self.finished:
            self.finished = True
            self._on_end(self, event, exc)

    async def _abatches(self) -> AsyncIterator[list[Event]]:
        import ray

        while not self.finished:
            try:
                ref = await self._stream.__anext__()
                events = self._accept(await ref)
            except StopAsyncIteration:
                return
            except _lost_errors() as exc:
                event = self._lost(exc)
                self._end(event, exc)
                events = [event]
            except ray.exceptions.RayError as exc:  # the replica's code failed
                event = FinishEvent("error", 0, 0, error=f"engine replica {self.replica} failed: {exc}")
                self._end(event, exc)
                events = [event]
            yield events

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            async for events in self._abatches():
                for event in events:
                    yield event
        finally:
            if not self.finished:
                self.cancel()  # the consumer went away (client disconnect)

    def __iter__(self) -> Iterator[Event]:
        import ray

        while not self.finished:
            try:
                ref = next(self._stream)
                events = self._accept(ray.get(ref))
            except StopIteration:
                return
            except _lost_errors() as exc:
                event = self._lost(exc)
                self._end(event, exc)
                events = [event]
            yield from events

    def subscribe(self, sink: Callable[[Event], None]) -> None:
        """Deliver events by calling sink(event): on the caller's event loop when it has one
        (the protocols' servers), else on a pump thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

        if loop is not None:

            async def pump() -> None:
                async for events in self._abatches():
                    for event in events:
                        sink(event)

            task = loop.create_task(pump())
            self._pump = task  # keep a reference: the loop holds tasks weakly
        else:

            def run() -> None:
                for event in self:
                    sink(event)

            threading.Thread(target=run, name="tokenwire-remote-stream", daemon=True).start()

    def result(self) -> tuple[list[TokenEvent], FinishEvent]:
        tokens: list[TokenEvent] = []
        for event in self:
            if isinstance(event, FinishEvent):
                return tokens, event
            tokens.append(event)  # type: ignore[arg-type]
        raise AssertionError("stream ended without a FinishEvent")
