"""LMTP over lines of text: stdin/stdout for `tokenwire lmtp --stdio`, or any line transport.

Each line is one frame (`TYPE JSON`; JSON never contains a raw newline). Reading starts at once,
while the model loads: frames wait for it (a client that negotiates the system extension is told
"loading", then "ready"). End of input means no more requests: the server finishes the streams
under way, sends their records and exits. If the output breaks, the streams are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from tokenwire.protocols.lmtp.runner import ConnectionRunner, Send

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

Recv = Callable[[], Awaitable[str | None]]
MAX_LINE_BYTES = 64 * 2**20


async def serve_lines(
    engine: EngineAPI | Awaitable[EngineAPI], recv: Recv, send: Send, *, aliases: Iterable[str] = ()
) -> None:
    """Serve one LMTP connection over a line transport. `engine` may still be loading; if
    loading fails, waiting requests get error records and the exception is raised."""
    ready = engine if not isinstance(engine, Awaitable) else None
    runner = ConnectionRunner(ready, send, aliases=aliases)
    loader = asyncio.ensure_future(engine) if ready is None else None  # type: ignore[arg-type]
    reading = asyncio.ensure_future(_read(runner, recv))
    try:
        if loader is not None:
            await asyncio.wait({reading, loader}, return_when=asyncio.FIRST_COMPLETED)
            if not loader.done():
                await asyncio.wait({loader})
            if loader.exception() is not None:
                runner.core.fail_parked(f"model failed to load: {loader.exception()}")
                runner.core.shutdown(f"model failed to load: {loader.exception()}")
                await runner.flush()
                raise loader.exception()  # type: ignore[misc]
            runner.set_engine(loader.result())
        await reading  # until end of input, then finish the streams under way
        while (runner.core.streams or runner.core.has_output) and not runner.send_failed:
            await runner.flush(timeout=0.05)
            await asyncio.sleep(0.01 if runner.core.streams else 0)
    finally:
        reading.cancel()
        if loader is not None:
            loader.cancel()
        await runner.close()


async def _read(runner: ConnectionRunner, recv: Recv) -> None:
    while (line := await recv()) is not None and not runner.send_failed:
        if line.strip():
            runner.feed(line)


async def serve_stdio(load: Callable[[], EngineAPI], *, aliases: Iterable[str] = ()) -> EngineAPI | None:
    """Serve LMTP on this process's stdin/stdout; the model loads (in a thread) meanwhile.
    Returns the engine (for the caller to shut down), or None if loading never finished."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)

    async def send(text: str) -> None:
        writer.write(text.encode() + b"\n")
        await writer.drain()

    async def recv() -> str | None:
        try:
            line = await reader.readline()
        except ValueError:  # a line over the limit: skip it, answer with an error frame
            return "OVERSIZED {}"
        return line.decode("utf-8", "replace").rstrip("\r\n") if line else None

    engine_future = loop.run_in_executor(None, load)
    try:
        await serve_lines(engine_future, recv, send, aliases=aliases)
    finally:
        with contextlib.suppress(Exception):
            writer.close()
    return engine_future.result() if engine_future.done() and not engine_future.exception() else None
