"""Running one LmtpConnection on an asyncio loop (shared by the WebSocket and stdio transports).

Engine events arrive on the model thread through RequestHandle.subscribe; they go into an
EventChannel, which wakes the loop once per batch, so everything one engine step produced (for
all of the connection's streams) is handled together and leaves as one TOKEN frame. A writer task
sends frames in order; while a send waits on a slow client, new records pile up into the next,
larger frame instead of queueing frame by frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from tokenwire.engine.events import EventChannel
from tokenwire.engine.request import Event, RequestHandle
from tokenwire.protocols.lmtp.core import LmtpConnection
from tokenwire.protocols.lmtp.streams import Stream

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.lmtp.extensions import KeptBuffers

log = logging.getLogger("tokenwire.lmtp")
Send = Callable[[str], Awaitable[None]]


class ConnectionRunner:
    def __init__(
        self,
        engine: EngineAPI | None,
        send: Send,
        *,
        aliases: Iterable[str] = (),
        tick_s: float = 0.5,
        peer: str | None = None,
        max_streams: int | None = None,
        owner: str = "",
        kept: KeptBuffers | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.core = LmtpConnection(
            engine, self._watch, aliases=aliases, peer=peer, max_streams=max_streams, owner=owner, kept=kept
        )
        self._send = send
        self._events: EventChannel[tuple[Stream, Event]] = EventChannel(self.loop, self._drain)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tick_s = tick_s
        self._writer = asyncio.create_task(self._write_loop(), name="lmtp-writer")
        self._ticker = asyncio.create_task(self._tick_loop(), name="lmtp-ticker")
        self.send_failed = False

    # ------------------------------------------------------------------ inputs
    def feed(self, text: str) -> None:
        self.core.feed(text)
        self._kick()

    def set_engine(self, engine: EngineAPI) -> None:
        self.core.set_engine(engine)
        self._kick()

    def _watch(self, handle: RequestHandle, stream: Stream) -> None:
        handle.subscribe(functools.partial(self._push, stream))

    def _push(self, stream: Stream, event: Event) -> None:
        self._events.push((stream, event))  # model thread, engine lock held

    def _drain(self, batch: list[tuple[Stream, Event]]) -> None:
        self.core.on_events(batch)
        self._kick()

    def _kick(self) -> None:
        if self.core.has_output:
            self._idle.clear()
            self._wake.set()

    # ------------------------------------------------------------------ output
    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                for frame in self.core.take_frames():
                    await self._send(frame)
            except (ConnectionError, RuntimeError, OSError) as exc:
                log.debug("LMTP send failed: %s", exc)
                self.send_failed = True
                self._idle.set()
                return
            if not self.core.has_output:
                self._idle.set()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            if "system" in self.core.enabled:
                self.core.tick()
                self._kick()

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until every frame produced so far has been sent (or sending failed)."""
        self._kick()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    # ------------------------------------------------------------------ ending
    async def shutdown(self, message: str = "server shutting down") -> None:
        """Server stopping: tell the client, end its streams with error records, send, close."""
        self.core.shutdown(message)
        self._kick()
        if not self.send_failed:
            await self.flush()
        await self.close()

    async def close(self) -> None:
        """Client gone: cancel its streams, free its sessions, stop the tasks."""
        self.core.close()
        for task in (self._writer, self._ticker):
            task.cancel()
        for task in (self._writer, self._ticker):
            with contextlib.suppress(asyncio.CancelledError):
                await task
