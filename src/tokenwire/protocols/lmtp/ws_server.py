"""LMTP over WebSocket (aiohttp) at path "/": text frames `TYPE JSON`, as LMQL's client speaks it."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from tokenwire.protocols.http_site import start_site
from tokenwire.protocols.lmtp.runner import ConnectionRunner

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

log = logging.getLogger("tokenwire.lmtp")
MAX_MESSAGE_BYTES = 64 * 2**20  # a full-vocabulary logit_bias is a few MiB


class LmtpServer:
    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        aliases: Iterable[str] = (),
        sock: socket.socket | None = None,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.sock = sock  # bound before the model loaded (tokenwire serve)
        self.aliases = tuple(aliases)
        self._connections: dict[ConnectionRunner, web.WebSocketResponse] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> LmtpServer:
        app = web.Application()
        app.router.add_get("/", self._handle)
        self._runner, self.port = await start_site(app, self.host, self.port, self.sock, "--lmtp-port")
        log.info("LMTP listening on ws://%s:%d/ (model %s)", self.host, self.port, self.engine.name)
        return self

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/"

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, compress=False)
        if not ws.can_prepare(request).ok:
            return web.Response(
                status=426, text="LMTP endpoint: connect with a WebSocket\n", headers={"Upgrade": "websocket"}
            )
        await ws.prepare(request)
        runner = ConnectionRunner(self.engine, ws.send_str, aliases=self.aliases, peer=request.remote)
        self._connections[runner] = ws
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    runner.feed(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    runner.feed(msg.data.decode("utf-8", "replace"))
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            if self._connections.pop(runner, None) is not None:
                await runner.close()  # disconnect: cancels the client's streams
        return ws

    async def stop(self, message: str = "server shutting down") -> None:
        for runner, ws in list(self._connections.items()):
            self._connections.pop(runner, None)
            await runner.shutdown(message)
            await ws.close(code=1001, message=b"server shutting down")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

