"""LMTP over WebSocket (aiohttp) at path "/": text frames `TYPE JSON`, as LMQL's client speaks it.

With --auth-token the handshake must carry `Authorization: Bearer TOKEN` or `?token=TOKEN`
(LMQL's stock client sends neither, so it reaches only a token-less server); otherwise the
upgrade is refused with HTTP 401 before any WebSocket exists.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiohttp import WSCloseCode, WSMsgType, web

from tokenwire.protocols.http_site import start_site
from tokenwire.protocols.lmtp.core import frame_budget
from tokenwire.protocols.lmtp.extensions import KeptBuffers
from tokenwire.protocols.lmtp.runner import ConnectionRunner
from tokenwire.protocols.security import aiohttp_auth, http_owner, owner_of

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.lmtp")
MAX_MESSAGE_BYTES = 64 * 2**20  # the cap whatever the model (a full-vocabulary logit_bias is a few MiB)
HEARTBEAT_S = 30.0
# The transport's cap is this many times the model's frame budget (core.frame_budget, in
# characters): a character is at most 4 UTF-8 bytes, so every frame the core would read arrives;
# frames between the budget and the cap get the core's error record on their stream; past the
# cap the frame is refused from its header, before a byte of it is buffered (a 10^7-id prompt,
# 30 MB, was received whole against the 64 MiB cap: RSS +53 MiB).
BUDGET_FACTOR = 4


def max_message_bytes(engine: EngineAPI) -> int:
    return min(MAX_MESSAGE_BYTES, BUDGET_FACTOR * frame_budget(engine))


class _LmtpWebSocket(web.WebSocketResponse):
    """aiohttp closes an over-size message with 1009 and no reason; ours names the limit (the
    frame is unread, so its stream_id is unknown and no error record can name the stream)."""

    too_big_reason = b""

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        if code == WSCloseCode.MESSAGE_TOO_BIG and not message:
            message = self.too_big_reason
        return await super().close(code=code, message=message, drain=drain)


class LmtpServer:
    def __init__(
        self,
        engine: EngineAPI,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        aliases: Iterable[str] = (),
        sock: socket.socket | None = None,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        idle_timeout_s: float | None = None,
        max_streams: int | None = None,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.sock = sock  # bound before the model loaded (tokenwire serve)
        self.aliases = tuple(aliases)
        self.auth_token = auth_token
        self.ssl_context = ssl_context
        self.idle_timeout_s = idle_timeout_s  # close a connection with no stream for this long
        self.max_streams = max_streams
        self._connections: dict[ConnectionRunner, web.WebSocketResponse] = {}
        self.kept = KeptBuffers()  # buffers kept past their connections (and restarts: --state-dir)
        self._runner: web.AppRunner | None = None

    async def start(self) -> LmtpServer:
        auth = aiohttp_auth(self.auth_token, "lmtp", _unauthorized, query_param="token")
        app = web.Application(middlewares=[auth] if auth is not None else [])
        app.router.add_get("/", self._handle)
        self._runner, self.port = await start_site(
            app, self.host, self.port, self.sock, "--lmtp-port", self.ssl_context
        )
        log.info("LMTP listening on %s (model %s)", self.url, self.engine.name)
        return self

    @property
    def url(self) -> str:
        return f"{'wss' if self.ssl_context else 'ws'}://{self.host}:{self.port}/"

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        # heartbeat: a peer that vanished without a FIN (pulled cable, killed VM) stops answering
        # pings and is closed within ~2 heartbeats, freeing its engine requests
        limit = max_message_bytes(self.engine)
        ws = _LmtpWebSocket(max_msg_size=limit, compress=False, heartbeat=HEARTBEAT_S)
        # a close reason is at most 123 bytes: this one is ~90
        ws.too_big_reason = (
            f"message over {limit} bytes: larger than any request within "
            f"--max-model-len {self.engine.max_model_len}"
        ).encode()[:123]
        if not ws.can_prepare(request).ok:
            return web.Response(
                status=426, text="LMTP endpoint: connect with a WebSocket\n", headers={"Upgrade": "websocket"}
            )
        await ws.prepare(request)
        # whose kept buffers this connection sees: the token it presented (header, else ?token=)
        query = request.query.get("token")
        in_query = query and "authorization" not in request.headers
        owner = owner_of(query) if in_query else http_owner(request.headers)
        runner = ConnectionRunner(
            self.engine, ws.send_str, aliases=self.aliases, peer=request.remote, max_streams=self.max_streams,
            owner=owner, kept=self.kept,
        )  # fmt: skip
        self._connections[runner] = ws
        try:
            while True:
                try:
                    msg = await ws.receive(timeout=self.idle_timeout_s)
                except TimeoutError:
                    if runner.core.streams:
                        continue  # streams running: not idle
                    log.info("LMTP: closing %s after %.0fs idle", request.remote, self.idle_timeout_s)
                    await ws.close(code=1000, message=b"idle timeout")
                    break
                if msg.type == WSMsgType.TEXT:
                    runner.feed(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    runner.feed(msg.data.decode("utf-8", "replace"))
                elif msg.type in (WSMsgType.ERROR, WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
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


def _unauthorized(message: str) -> web.Response:
    return web.Response(
        status=401, text=f"LMTP: {message} or ?token=<token>\n", headers={"WWW-Authenticate": "Bearer"}
    )
