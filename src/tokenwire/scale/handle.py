"""The front-end's end of a request running on a replica: a RequestHandle (its subscribe and
result), fed by the facade's per-replica event pump (facade.py) instead of the engine's model thread.

Events arrive in batches (one per engine step) as the replica produces them. If the replica dies
mid-stream, the stream ends with FinishEvent(reason="error", unavailable=True) naming the lost
replica. `cancel` sends the replica's `cancel` at once (an actor call beside the event stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenwire.engine.events import EventFeed
from tokenwire.engine.request import Event, FinishEvent, RequestHandle, TokenEvent

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


class RemoteHandle(RequestHandle):
    def __init__(
        self,
        replica: int,
        actor: Any,
        key: str,
        on_end: Callable[[RemoteHandle, FinishEvent, BaseException | None], None],
    ) -> None:
        super().__init__(EventFeed())
        self.replica = replica
        self.key = key
        self._actor = actor
        self._on_end = on_end
        self._session_id = ""
        self._cached = 0
        self._finished = False
        self.load = 0.0  # what the router counted for it
        self.origin: Any = None
        self.ephemeral = False  # started without a session (the replica made a one-request one)
        self.arrived = time.monotonic()
        self.token_times: list[float] = []  # when each generated token reached this process

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def cached_tokens(self) -> int:
        return self._cached

    @property
    def finished(self) -> bool:
        return self._finished

    def started(self, session_id: str, cached_tokens: int) -> None:
        self._session_id, self._cached = session_id, cached_tokens

    def cancel(self) -> None:
        if not self._finished:
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
        self._feed.push_all(events)

    def fail(self, exc: BaseException) -> None:
        """The replica died with the request unfinished."""
        if self._finished:
            return
        event = lost_event(self.replica, exc)
        self._end(event, exc)
        self._feed.push(event)

    def _end(self, event: FinishEvent, exc: BaseException | None) -> None:
        if not self._finished:
            self._finished = True
            self._on_end(self, event, exc)
