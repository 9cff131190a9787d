"""The OpenAI-compatible API over HTTP: FastAPI routes served by uvicorn in the server's loop.

Routes only move values: the body (validated by FastAPI against schemas.py) goes to the core
for a Plan, the plan to the engine (runner.py), the engine's events back through the core to
JSON or server-sent events. Errors of every kind leave in OpenAI's shape (errors.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tokenwire import metrics
from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import Origin
from tokenwire.protocols.anthropic.routes import add_anthropic_routes
from tokenwire.protocols.connection_guard import ListenerGuard
from tokenwire.protocols.embeddings import routes as embedding_routes
from tokenwire.protocols.ollama.routes import add_ollama_routes
from tokenwire.protocols.openai import core, responses
from tokenwire.protocols.openai.api_key import ApiKeyMiddleware, guard_paths
from tokenwire.protocols.openai.body_limit import DEFAULT_MAX_BODY_MB, BodyLimitMiddleware
from tokenwire.protocols.openai.errors import OpenAIError, from_engine
from tokenwire.protocols.openai.images import vision_of
from tokenwire.protocols.openai.playground import add_playground_routes
from tokenwire.protocols.openai.runner import Execution, watch_disconnect
from tokenwire.protocols.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenwire.protocols.openai.sessions import add_session_routes, check_owner
from tokenwire.protocols.responses.routes import add_responses_routes
from tokenwire.protocols.security import auth_token, tls_files

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.openai")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def limits_of(engine: EngineAPI) -> core.ModelLimits:
    concepts = engine.concepts
    return core.ModelLimits(
        name=engine.name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        logits_size=engine.logits_size,
        eos_ids=frozenset(engine.eos_ids),
        engine=engine.limits,
        concept_names=tuple(concepts.names) if concepts is not None else (),
        concept_layers=tuple(concepts.layers) if concepts is not None else (),
        vision=vision_of(engine),
    )


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error_response(exc: OpenAIError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _field(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted request field (the leading "body" dropped, and the
    union-member names pydantic inserts, such as `str` or `list[int]`)."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    return ".".join(parts) or "body"


class OpenAIApp:
    """The routes, bound to one engine."""

    def __init__(
        self,
        engine: EngineAPI,
        *,
        api_key: str | None = None,
        max_queued: int = 256,
        metrics: Callable[[], tuple[bytes, str]] | None = None,
        max_body_mb: float = DEFAULT_MAX_BODY_MB,
    ) -> None:
        self.engine = engine
        self.max_body_bytes = int(max_body_mb * 2**20)
        self.limits = limits_of(engine)
        self.api_key = api_key
        self.max_queued = max_queued
        self.metrics = metrics
        self.active: set[Execution] = set()  # requests running now, aborted when the server stops
        self.app = FastAPI(title="tokenwire OpenAI-compatible API", version="1.0")
        self._install()

    # ------------------------------------------------------------------ plumbing
    def _install(self) -> None:
        app = self.app

        @app.exception_handler(OpenAIError)
        async def _openai_error(_: Request, exc: OpenAIError) -> Response:
            return _error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> Response:
            first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
            param = _field(tuple(first.get("loc", ("body",))))
            message = f"{param}: {first.get('msg', 'invalid value')}"
            if len(exc.errors()) > 1:
                others = ", ".join(_field(tuple(e.get("loc", ()))) for e in exc.errors()[1:4])
                message += f" (also invalid: {others})"
            return _error_response(OpenAIError(400, message, param=param, code="invalid_value"))

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, exc: StarletteHTTPException) -> Response:
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return _error_response(OpenAIError(exc.status_code, str(exc.detail), type=kind))

        app.add_middleware(BodyLimitMiddleware, max_bytes=self.max_body_bytes, respond=_error_response)
        if self.api_key is not None:  # added last: runs first, so a refused request reads no body
            app.add_middleware(ApiKeyMiddleware, api_key=self.api_key)

        app.get("/health")(self.health)
        app.get("/ready")(self.ready)
        app.get("/metrics")(self.metrics_route)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id}")(self.model)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        add_session_routes(app, self.engine, self.limits)
        add_playground_routes(app, self.engine)  # the web page at / (issue 19)
        self.response_store = add_responses_routes(self)  # OpenAI's Responses API, /v1/responses (issue 43)
        add_anthropic_routes(app, self, guard_paths)  # Anthropic's Messages API (issue 43)
        embedding_routes.add_routes(app, self.engine, self.limits, self._check_capacity, guard_paths)
        add_ollama_routes(app, self.engine, self.limits, self.active, self.max_queued)  # /api (issue 43)

    def _check_capacity(self) -> None:
        waiting = self.engine.stats()["waiting"]
        if waiting >= self.max_queued:
            raise OpenAIError(
                429,
                f"the server is saturated: {waiting} requests are queued (--max-queued "
                f"{self.max_queued}); retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    # ------------------------------------------------------------------ info routes
    async def health(self) -> Response:
        """200 once the model is loaded (this server starts after it); engine counters for probes."""
        stats = self.engine.stats()
        return _json(
            {
                "status": "ok",
                "model": self.engine.name,
                "running": stats["running"],
                "waiting": stats["waiting"],
                "sessions": stats["sessions"],
            }
        )

    async def ready(self) -> Response:
        """200 when a request would be admitted now, 503 when the queue is full."""
        waiting = self.engine.stats()["waiting"]
        if waiting >= self.max_queued:
            return _json({"status": "saturated", "waiting": waiting}, 503, {"Retry-After": "1"})
        return _json({"status": "ready", "waiting": waiting})

    async def metrics_route(self) -> Response:
        if self.metrics is None:
            raise OpenAIError(404, "no metrics collector is installed in this server", type="not_found_error")
        body, content_type = self.metrics()
        return Response(body, media_type=content_type)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.engine.name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenwire",
            "context_length": self.engine.max_model_len,
            "max_model_len": self.engine.max_model_len,
            "pooling": embedding_routes.pooling_for(self.engine).mode,  # of /v1/embeddings
        }

    async def models(self) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        core.check_model(model_id, self.limits)
        return _json(self._model_card())

    # ------------------------------------------------------------------ generation routes
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions; tokenwire's extensions go in the body (`extra_body`)."""
        return await self._run(
            request, lambda tokens: core.plan_chat(body, self.limits, tokens), body.session
        )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """OpenAI's legacy completions (prompt as text, token ids or lists of either)."""
        return await self._run(
            request, lambda tokens: core.plan_completion(body, self.limits, tokens), body.session
        )

    async def _run(
        self, request: Request, make_plan: Callable[[Any], core.Plan], session: str | None
    ) -> Response:
        self._check_capacity()
        tokens = None
        if session is not None:
            try:
                check_owner(self.engine, session, request)  # another key's session: unknown
                tokens = self.engine.session_tokens(session)
            except EngineError as exc:
                raise from_engine(exc) from exc
        plan = make_plan(tokens)
        peer = f"{request.client.host}:{request.client.port}" if request.client else None
        origin = Origin("openai", "chat.completions" if plan.kind == "chat" else "completions", peer)
        for _, options in plan.choices:
            options.origin = origin  # the access log and the per-protocol metrics
        run = Execution(self.engine, plan)
        run.submit()
        self.active.add(run)
        if plan.stream:
            return StreamingResponse(self._stream(run), media_type="text/event-stream", headers=SSE_HEADERS)
        watcher = asyncio.create_task(watch_disconnect(request, run))
        try:
            async for batch in run.batches():
                for index, event in batch:
                    plan.outputs[index].feed(event)
        finally:
            watcher.cancel()
            run.close()
            self.active.discard(run)
        build = responses.chat_response if plan.kind == "chat" else responses.completion_response
        return _json(build(plan))

    async def _stream(self, run: Execution) -> AsyncIterator[bytes]:
        """Server-sent events; a client that goes away cancels the stream (Starlette stops this
        generator), and closing it cancels the engine requests at once."""
        plan = run.plan
        first = [True] * len(plan.outputs)
        try:
            async for batch in run.batches():
                chunks = []
                for index, event in batch:
                    out = plan.outputs[index]
                    delta = out.feed(event)
                    finished = out.finish is not None and out.finish is event
                    if plan.kind == "chat":
                        chunk = responses.chat_chunk(plan, out, delta, first=first[index], finished=finished)
                        first[index] = False
                    else:
                        chunk = responses.completion_chunk(plan, out, delta, finished=finished)
                    if chunk is not None:
                        chunks.append(_sse(chunk))
                if chunks:
                    yield b"".join(chunks)
            if plan.include_usage:
                yield _sse(responses.usage_chunk(plan))
            yield DONE
        except OpenAIError as exc:
            # the status line is sent: the error goes as an event (the openai client raises it)
            yield _sse(exc.body())
            yield DONE
        finally:
            run.close()
            self.active.discard(run)

    def abort_all(self) -> None:
        """The server stops: every running request ends now with a 503 'server shutting down'
        (a stream gets it as its last event), so uvicorn's graceful shutdown does not wait."""
        for run in list(self.active):
            run.abort()


def _guarded_http_protocol(guard: ListenerGuard) -> Any:
    """uvicorn's `http=` protocol class, behind `guard` (connection_guard.py: deadlines on
    half-open requests, the per-address cap). uvicorn calls it with its keyword arguments for
    each accepted connection; the guard makes uvicorn's own protocol only for one it admits."""

    def make(**kwargs: Any) -> asyncio.Protocol:
        return guard.wrap(lambda: AutoHTTPProtocol(**kwargs))()

    return make


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside tokenwire's loop: signals stay with `tokenwire serve`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class OpenAIServer:
    def __init__(
        self,
        engine: EngineAPI,
        host: str = "127.0.0.1",
        port: int = 8000,
        sock: socket.socket | None = None,
        tls_files: tuple[str, str] | None = None,
        **options: Any,
    ) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.tls_files = tls_files  # (--tls-cert, --tls-key): serve HTTPS
        self.sock = sock  # bound before the model loaded (tokenwire serve)
        self.api = OpenAIApp(engine, **options)
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> OpenAIServer:
        config = uvicorn.Config(
            self.api.app,
            host=self.host,
            port=self.port,
            http=_guarded_http_protocol(ListenerGuard(f"--http-port {self.host}:{self.port}")),
            ws="none",  # no WebSocket routes; an upgrade would hand the socket past the guard
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            ssl_certfile=self.tls_files[0] if self.tls_files else None,
            ssl_keyfile=self.tls_files[1] if self.tls_files else None,
        )
        self._server = EmbeddedServer(config)
        self._task = asyncio.create_task(self._serve(), name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"OpenAI API could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("OpenAI API listening on %s (model %s)", self.url, self.engine.name)
        return self

    async def _serve(self) -> None:
        assert self._server is not None
        try:
            await self._server.serve(sockets=[self.sock] if self.sock is not None else None)
        except SystemExit as exc:  # uvicorn exits when it cannot bind
            raise OSError(f"OpenAI API could not listen on {self.host}:{self.port}") from exc

    @property
    def url(self) -> str:
        return f"{'https' if self.tls_files else 'http'}://{self.host}:{self.port}/v1"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self.api.abort_all()
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = None


async def start_from_args(
    engine: EngineAPI, args: argparse.Namespace, sock: socket.socket | None = None
) -> Callable[[], Awaitable[None]] | None:
    """The `tokenwire serve` starter: the OpenAI API on --host:--http-port (0 = off)."""
    port = getattr(args, "http_port", 8000)
    if not port:
        return None
    server = OpenAIServer(
        engine,
        getattr(args, "host", "127.0.0.1"),
        port,
        sock,
        tls_files(args),
        # --api-key (this API's own, older flag) wins; else the one --auth-token of every protocol
        api_key=getattr(args, "api_key", None) or auth_token(args),
        max_queued=getattr(args, "max_queued", 256),
        max_body_mb=getattr(args, "http_max_body_mb", DEFAULT_MAX_BODY_MB),
        metrics=metrics.exposition,  # issue 13: /metrics on this port too
    )
    await server.start()
    return server.stop
