"""Starting an aiohttp application on a bound socket, shared by the HTTP-based transports."""

from __future__ import annotations

import socket
import ssl

from aiohttp import web

from tokenwire.protocols.serving import bind_tcp


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    sock: socket.socket | None = None,
    flag: str = "port",
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on `sock` (bound by `tokenwire serve` before the model loaded), or else on
    host:port (0 = a free port), over TLS with `ssl_context` (--tls-cert); returns its runner
    and the bound port.

    Signals stay with `tokenwire serve` (handle_signals=False); the protocols write their own
    access log lines."""
    if sock is None:
        sock = bind_tcp(host, port, flag)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock, ssl_context=ssl_context)
    await site.start()
    return runner, int(sock.getsockname()[1])
