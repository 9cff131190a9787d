"""Ollama's API on its own port (--ollama-port; Ollama's clients default to 11434): the same
routes as on --http-port, plus `GET /` ("Ollama is running", the clients' liveness probe), with
the same API key, TLS, body limit and connection guard as the OpenAI API's port."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenwire.protocols.connection_guard import ListenerGuard
from tokenwire.protocols.ollama.errors import OllamaError
from tokenwire.protocols.ollama.routes import add_ollama_routes, error_response
from tokenwire.protocols.openai.body_limit import DEFAULT_MAX_BODY_MB, BodyLimitMiddleware
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.runner import Execution
from tokenwire.protocols.openai.transport import (
    ApiKeyMiddleware,
    EmbeddedServer,
    _guarded_http_protocol,
    limits_of,
)
from tokenwire.protocols.security import auth_token, tls_files
from tokenwire.protocols.serving import Stopper

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.ollama")


def ollama_app(
    engine: EngineAPI, active: set[Execution], *, api_key: str | None, max_queued: int, max_body_mb: float
) -> FastAPI:
    app = FastAPI(title="tokenwire Ollama API", openapi_url=None, docs_url=None, redoc_url=None)
    add_ollama_routes(app, engine, limits_of(engine), active, max_queued)

    async def running() -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    app.get("/")(running)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(OllamaError(exc.status_code, str(exc.detail)))

    def too_large(exc: OpenAIError) -> Any:
        return error_response(OllamaError(exc.status, exc.message, exc.headers))

    app.add_middleware(BodyLimitMiddleware, max_bytes=int(max_body_mb * 2**20), respond=too_large)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


async def start_ollama_server(engine: EngineAPI, sock: socket.socket, args: argparse.Namespace) -> Stopper:
    host, port = sock.getsockname()[:2]
    tls = tls_files(args)
    active: set[Execution] = set()
    app = ollama_app(
        engine,
        active,
        api_key=getattr(args, "api_key", None) or auth_token(args),
        max_queued=getattr(args, "max_queued", 256),
        max_body_mb=getattr(args, "http_max_body_mb", DEFAULT_MAX_BODY_MB),
    )
    config = uvicorn.Config(
        app,
        http=_guarded_http_protocol(ListenerGuard(f"--ollama-port {host}:{port}")),
        ws="none",
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="ollama-http")
    while not server.started:
        if task.done():
            task.result()
            raise OSError(f"the Ollama API could not listen on {host}:{port}")
        await asyncio.sleep(0.01)
    log.info(
        "Ollama API listening on %s://%s:%s (model %s)", "https" if tls else "http", host, port, engine.name
    )

    async def stop() -> None:
        for run in list(active):
            run.abort()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task

    return stop
