"""GraphPipe over HTTP (aiohttp): POST a flatbuffer Request to a model's path, GET its metadata.

Paths: `/NAME` for each model (`--graphpipe-model NAME=PATH`, and the engine's LM under its
name), `/` for the default model (the LM), and the lifecycle routes of Oracle's Go server,
`/control/is_ready` and `/control/is_alive` ("ok" with 200, 503 otherwise), plus
`/control/stats` (JSON counters: requests, model calls, cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tokenwire.logs import access_log
from tokenwire.metrics import REQUESTS
from tokenwire.protocols.graphpipe.cache import ResponseCache
from tokenwire.protocols.graphpipe.core import ModelEndpoint, Reply, error_reply
from tokenwire.protocols.graphpipe.errors import ErrorCode, GraphPipeError
from tokenwire.protocols.graphpipe.models import DEFAULT_SPIN_US
from tokenwire.protocols.graphpipe.models.base import TensorModel
from tokenwire.protocols.graphpipe.pages import metadata_html, metadata_json
from tokenwire.protocols.http_site import start_site
from tokenwire.protocols.security import aiohttp_auth, auth_token, ssl_context
from tokenwire.protocols.serving import SHUTDOWN_MESSAGE

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.graphpipe")
FLATBUFFER = "application/octet-stream"
# A lone request (one client connection, nothing else in flight) to a model whose recent calls
# took under this long runs on the event loop thread: no thread hand-off there and back
DEFAULT_INLINE_MS = 5.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went before the answer


class GraphPipeServer:
    def __init__(
        self,
        models: list[TensorModel],
        host: str = "127.0.0.1",
        port: int = 9000,
        *,
        default: str | None = None,
        batch_window_ms: float = 0.0,
        max_batch: int = 64,
        max_request_mb: float = 256.0,
        cache_mb: float = 0.0,
        inline_ms: float = DEFAULT_INLINE_MS,
        executor: ThreadPoolExecutor | None = None,
        sock: socket.socket | None = None,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if not models:
            raise ValueError("GraphPipe needs at least one model")
        self.host, self.port = host, port
        self.sock = sock  # bound before the model loaded (tokenwire serve)
        self.auth_token, self.ssl_context = auth_token, ssl_context
        self.max_in_flight = max_in_flight  # --max-queued: POSTs being served beyond it get 429
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.cache = ResponseCache(int(cache_mb * 2**20)) if cache_mb > 0 else None
        self.endpoints = {
            m.name: ModelEndpoint(
                m,
                window_s=batch_window_ms / 1000,
                max_batch=max_batch,
                cache=self.cache,
                inline_max_s=inline_ms / 1000,
            )
            for m in models
        }
        self.default = default or models[0].name
        self.executor = executor
        self.ready = False
        self._runner: web.AppRunner | None = None
        self._posts_in_flight = 0  # POSTs being served, for ModelEndpoint.handle(alone=...)
        self._posts: set[asyncio.Task[Any]] = set()  # their handler tasks (ended on shutdown)
        self._shutting_down: str | None = None

    async def start(self) -> GraphPipeServer:
        auth = aiohttp_auth(
            self.auth_token,
            "graphpipe",
            _unauthenticated,
            open_paths=("/control/is_ready", "/control/is_alive"),
        )
        app = web.Application(
            client_max_size=self.max_request_bytes + 1, middlewares=[auth] if auth is not None else []
        )
        app.router.add_get("/control/is_ready", self._is_ready)
        app.router.add_get("/control/is_alive", self._is_alive)
        app.router.add_get("/control/stats", self._stats)
        app.router.add_route("*", "/", self._model_route)
        app.router.add_route("*", "/{name}", self._model_route)
        # a call sends nothing until it is done: without cancellation a client that left was
        # noticed only then (a [16, 2048] call ran on for 289 CPU-seconds)
        self._runner, self.port = await start_site(
            app,
            self.host,
            self.port,
            self.sock,
            "--graphpipe-port",
            self.ssl_context,
            cancel_on_disconnect=True,
        )
        self.ready = True
        log.info("GraphPipe listening on %s (models %s)", self.url, ", ".join(self.paths()))
        return self

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}/"

    def paths(self) -> dict[str, str]:
        return {name: f"/{name}" for name in self.endpoints} | {f"{self.default} (default)": "/"}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: {
                "requests": ep.batcher.requests,
                "model_calls": ep.batcher.model_calls,
                "largest_batch": ep.batcher.largest_batch,
            }
            for name, ep in self.endpoints.items()
        }
        if self.cache is not None:
            out["cache"] = {"entries": len(self.cache), "bytes": self.cache.bytes, "hits": self.cache.hits}
        return out

    # ------------------------------------------------------------------ routes
    async def _is_ready(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n") if self.ready else web.Response(status=503, text="not ready\n")

    async def _is_alive(self, request: web.Request) -> web.Response:
        return (
            web.Response(text="ok\n")
            if self._runner is not None
            else web.Response(status=503, text="not alive\n")
        )

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _model_route(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name") or self.default
        endpoint = self.endpoints.get(name)
        if request.method == "POST":
            return await self._post(request, endpoint, name)
        if request.method not in ("GET", "HEAD"):
            return web.Response(
                status=405, text="GraphPipe: POST a flatbuffer Request, or GET the metadata\n"
            )
        if endpoint is None:
            return web.json_response({"error": f"no model {name!r}", "models": self.paths()}, status=404)
        path = "/" if not request.match_info.get("name") else f"/{name}"
        if "text/html" in request.headers.get("Accept", ""):
            return web.Response(
                text=metadata_html(endpoint.metadata, path, self.paths()), content_type="text/html"
            )
        return web.Response(
            text=json.dumps(metadata_json(endpoint.metadata, path, self.paths()), indent=1),
            content_type="application/json",
        )

    async def _post(
        self, request: web.Request, endpoint: ModelEndpoint | None, name: str
    ) -> web.StreamResponse:
        self._posts_in_flight += 1
        started = time.monotonic()
        reply: Reply | None = None
        lost = False  # the client's connection went before its body arrived
        task = asyncio.current_task()
        assert task is not None
        self._posts.add(task)
        try:
            if self._shutting_down is not None:
                reply = error_reply(GraphPipeError(ErrorCode.UNAVAILABLE, self._shutting_down))
                return self._respond(reply)
            if self.max_in_flight is not None and self._posts_in_flight > self.max_in_flight:
                message = (
                    f"the server is saturated: {self._posts_in_flight - 1} requests in flight "
                    f"(--max-queued {self.max_in_flight}); retry shortly"
                )
                reply = error_reply(GraphPipeError(ErrorCode.OVERLOADED, message))
                return self._respond(reply)
            try:
                try:
                    body = await self._read_body(request)
                except ConnectionError:
                    # the connection went while the body was arriving (the guard's 408 to a
                    # stalled body, --body-timeout, or the client left): no one to answer and no
                    # server error; raised, aiohttp logged a traceback at ERROR per request, a
                    # log flood for a client stalling on purpose (the guard logs the stall once)
                    lost = True
                    log.debug(
                        "POST /%s from %s: connection lost while reading the body", name, request.remote
                    )
                    return web.Response(status=CLIENT_CLOSED_REQUEST)  # never sent
                if body is None or endpoint is None:
                    reply = self._refusal(body is None, name)
                else:
                    reply = await endpoint.handle(body, alone=self._alone())
            except asyncio.CancelledError:
                if self._shutting_down is None:
                    raise  # the client went away
                task.uncancel()
                reply = error_reply(GraphPipeError(ErrorCode.UNAVAILABLE, self._shutting_down))
            return self._respond(reply)
        finally:
            self._posts.discard(task)
            self._posts_in_flight -= 1
            outcome = (
                "cancelled" if lost else "error" if reply is None or reply.error_code is not None else "ok"
            )
            REQUESTS.labels("graphpipe", outcome).inc()
            access_log(
                "graphpipe", f"POST /{name}", outcome, peer=request.remote,
                duration_s=time.monotonic() - started,
            )  # fmt: skip

    def _alone(self) -> bool:
        """This is the only request in flight and its connection the only one open, so no
        other GraphPipe request can arrive before it is answered (HTTP/1.1: one request at a
        time per connection). Then no batch can form, and the batcher skips its queue."""
        if self._posts_in_flight != 1 or self._runner is None or self._runner.server is None:
            return False
        return len(self._runner.server.connections) == 1

    def _refusal(self, too_large: bool, name: str) -> Reply:
        if too_large:
            return error_reply(
                GraphPipeError(
                    ErrorCode.TOO_LARGE,
                    f"request body over the {self.max_request_bytes / 2**20:g} MiB limit "
                    "(--graphpipe-max-request-mb)",
                )
            )
        return error_reply(
            GraphPipeError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; models: {sorted(self.endpoints)}")
        )

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The whole body, or None (after draining it, so the client reads our answer) when it
        is over the limit."""
        length = request.content_length
        if length is not None and length <= self.max_request_bytes:
            return await request.content.readexactly(length) if length else b""
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size <= self.max_request_bytes:
                chunks.append(chunk)
            else:
                chunks.clear()  # keep draining, keep nothing
        return b"".join(chunks) if size <= self.max_request_bytes else None

    @staticmethod
    def _respond(reply: Reply) -> web.Response:
        headers = {"X-GraphPipe-Error-Code": str(reply.error_code)} if reply.error_code is not None else None
        return web.Response(status=reply.status, body=reply.body, content_type=FLATBUFFER, headers=headers)

    async def stop(self, message: str = SHUTDOWN_MESSAGE, wait_s: float = 2.0) -> None:
        """Stop: requests being served get error UNAVAILABLE(message) (HTTP 503), then the
        site closes."""
        self.ready = False
        self._shutting_down = message
        posts = list(self._posts)
        for task in posts:
            task.cancel()
        if posts:
            await asyncio.wait(posts, timeout=wait_s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for endpoint in self.endpoints.values():
            await endpoint.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


def _unauthenticated(message: str) -> web.Response:
    reply = error_reply(GraphPipeError(ErrorCode.UNAUTHENTICATED, message))
    headers = {"X-GraphPipe-Error-Code": str(reply.error_code), "WWW-Authenticate": "Bearer"}
    return web.Response(status=reply.status, body=reply.body, content_type=FLATBUFFER, headers=headers)


def parse_model_spec(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path or "/" in name or name == "control":
        raise argparse.ArgumentTypeError(
            f"--graphpipe-model wants NAME=PATH (NAME without '/'), got {spec!r}"
        )
    return name, path


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("GraphPipe")
    g.add_argument("--graphpipe-port", type=int, default=9000, help="GraphPipe HTTP port (0 = off)")
    g.add_argument(
        "--graphpipe-model",
        type=parse_model_spec,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve an ONNX model at /NAME (repeatable); the LM is always at / and /MODEL-NAME",
    )
    g.add_argument(
        "--graphpipe-batch-window-ms",
        type=float,
        default=0.0,
        help="extra wait for more requests to batch once the model is free (default 0: batches form "
        "from the requests that queue while the model is busy)",
    )
    g.add_argument("--graphpipe-max-batch", type=int, default=64, help="rows per merged model call")
    g.add_argument("--graphpipe-max-request-mb", type=float, default=256.0, help="largest request body")
    g.add_argument("--graphpipe-cache-mb", type=float, default=0.0, help="response cache size (0 = off)")
    g.add_argument("--graphpipe-onnx-threads", type=int, default=2, help="onnxruntime intra-op threads")
    g.add_argument(
        "--graphpipe-onnx-spin-us",
        type=int,
        default=DEFAULT_SPIN_US,
        help="how long an idle onnxruntime worker thread spins before it sleeps (0 = never spins)",
    )
    g.add_argument(
        "--graphpipe-inline-ms",
        type=float,
        default=DEFAULT_INLINE_MS,
        help="run a lone request on the event loop thread when the model's recent calls took under "
        "this long (0 = always in the thread pool)",
    )


def build_server(
    engine: EngineAPI | None,
    args: argparse.Namespace,
    host: str,
    port: int,
    sock: socket.socket | None = None,
) -> GraphPipeServer:
    # local: onnxruntime takes a while to import; only --graphpipe-onnx serves ONNX models
    from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel

    models: list[TensorModel] = []
    if engine is not None:
        # local: the language model wraps the engine (torch); only --graphpipe-lm serves it
        from tokenwire.protocols.graphpipe.models.lm_model import LanguageModel

        models.append(LanguageModel(engine))
    specs = getattr(args, "graphpipe_model", []) or []
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="graphpipe-onnx") if specs else None
    threads = getattr(args, "graphpipe_onnx_threads", 2)
    spin_us = getattr(args, "graphpipe_onnx_spin_us", DEFAULT_SPIN_US)
    for name, path in specs:
        assert executor is not None
        models.append(OnnxModel(name, path, executor, intra_op_threads=threads, spin_us=spin_us))
    return GraphPipeServer(
        models,
        host,
        port,
        batch_window_ms=getattr(args, "graphpipe_batch_window_ms", 0.0),
        max_batch=getattr(args, "graphpipe_max_batch", 64),
        max_request_mb=getattr(args, "graphpipe_max_request_mb", 256.0),
        cache_mb=getattr(args, "graphpipe_cache_mb", 0.0),
        inline_ms=getattr(args, "graphpipe_inline_ms", DEFAULT_INLINE_MS),
        executor=executor,
        sock=sock,
        auth_token=auth_token(args),
        ssl_context=ssl_context(args),
        max_in_flight=getattr(args, "max_queued", None),
    )
