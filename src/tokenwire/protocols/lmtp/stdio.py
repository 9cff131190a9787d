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
    from tokenwire.engine.engine import Engine

Recv = Callable[[], Awaitable[str | None]]
MAX_LINE_BYTES = 64 * 2**20


async def serve_lines(
    engine: Engine | Awaitable[Engine], recv: Recv, send: Send, *, aliases: Iterable[str] = ()
) -> None:
    """Serve one LMTP connection over a line transport. `engine` may still be loading."""
    loop = asyncio.get_running_loop()
    ready = engine if not isinstance(engine, Awaitable) else None
    runner = ConnectionRunner(ready, send, aliases=aliases)
    loader: asyncio.Future[Engine] | None = None
    if ready is None:
        loader = asyncio.ensure_future(engine)  # type: ignore[arg-type]
        loader.add_done_callback(
            lambda f: runner.set_engine(f.result()) if not f.cancelled() and f.exception() is None else None
        )
    try:
        while (line := await recv()) is not None:
            if line.strip():
                runner.feed(line)
            if runner.send_failed:
                return
        if loader is not None:
            await loader  # requests parked while loading still deserve answers
        while (runner.core.streams or runner.core.has_output) and not runner.send_failed:
            await runner.flush(timeout=0.05)
            await asyncio.sleep(0.01 if runner.core.streams else 0)
    finally:
        await runner.close()
        del loop


async def serve_stdio(load: Callable[[], Engine], *, aliases: Iterable[str] = ()) -> Engine | None:
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
