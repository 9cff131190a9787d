"""Starting an aiohttp application on a bound socket, shared by the HTTP-based transports."""

from __future__ import annotations

import asyncio
import socket
import ssl

from aiohttp import web

from tokenwire.protocols.connection_guard import ListenerGuard
from tokenwire.protocols.serving import bind_tcp


class GuardedSockSite(web.SockSite):
    """aiohttp's SockSite, with every accepted connection behind a ListenerGuard (deadlines on
    half-open requests, the per-address cap; connection_guard.py)."""

    __slots__ = ("guard",)

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        guard: ListenerGuard,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner (SockSite's own would bind)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.wrap(server), sock=self._sock, ssl=self._ssl_context, backlog=self._backlog
        )


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    sock: socket.socket | None = None,
    flag: str = "port",
    ssl_context: ssl.SSLContext | None = None,
    cancel_on_disconnect: bool = False,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on `sock` (bound by `tokenwire serve` before the model loaded), or else on
    host:port (0 = a free port), over TLS with `ssl_context` (--tls-cert); returns its runner
    and the bound port.

    Signals stay with `tokenwire serve` (handle_signals=False); the protocols write their own
    access log lines. `cancel_on_disconnect`: a handler whose client's connection closes is
    cancelled at once (aiohttp's handler_cancellation, off by default), for handlers that send
    nothing while they work (a GraphPipe call) and so would never notice the client leave."""
    if sock is None:
        sock = bind_tcp(host, port, flag)
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, handler_cancellation=cancel_on_disconnect
    )
    await runner.setup()
    bound = sock.getsockname()
    site = GuardedSockSite(runner, sock, ListenerGuard(f"{flag} {bound[0]}:{bound[1]}"), ssl_context)
    await site.start()
    return runner, int(bound[1])
