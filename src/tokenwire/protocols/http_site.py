"""Starting an aiohttp application on host:port, shared by the HTTP-based transports."""

from __future__ import annotations

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = a free port); returns its runner and the bound port.

    Signals stay with `tokenwire serve` (handle_signals=False); no access log per request."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    if port == 0 and server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    return runner, port
