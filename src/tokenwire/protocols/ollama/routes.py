"""Ollama's API as FastAPI routes: on --http-port beside the OpenAI API (its /api paths do not
collide) and on --ollama-port (server.py). Bodies are read and checked by core.py, not by
FastAPI, so every error leaves in Ollama's `{"error": "..."}` shape; generation runs through the
OpenAI side's runner (admission, cancellation, metrics and the access log alike), counted as
protocol "ollama"."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tokenwire.engine.request import Origin
from tokenwire.protocols.ollama import core, info
from tokenwire.protocols.ollama.embed import parse_embed, run_embed
from tokenwire.protocols.ollama.errors import OllamaError, bad_request, from_openai
from tokenwire.protocols.ollama.reply import Reply, created_at
from tokenwire.protocols.openai.api_key import guard_paths
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.runner import Execution, watch_disconnect

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits

NDJSON = "application/x-ndjson"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: OllamaError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers)


def auth_error(message: str) -> Response:
    """A missing or wrong API key on /api, in Ollama's shape (api_key.guard_paths)."""
    return json_response({"error": message}, 401)


async def read_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("missing request body")
    try:  # the standard library's json: integers of any size reach the range checks intact
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"invalid JSON in the request body: {exc}") from None


class OllamaRoutes:
    """The routes, bound to one engine. `active` is the server's set of running requests (those
    aborted when it stops, with a "server shutting down" error)."""

    def __init__(
        self, engine: EngineAPI, limits: ModelLimits, active: set[Execution], max_queued: int = 256
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.active = active
        self.max_queued = max_queued
        self.started_at = created_at()  # the model's "modified_at"
        self._info: info.ModelInfo | None = None

    @property
    def model(self) -> info.ModelInfo:
        """Read off the engine on first use (the app is also built over stand-in engines)."""
        if self._info is None:
            self._info = info.model_info(self.engine, self.limits, self.started_at)
        return self._info

    def install(self, app: FastAPI) -> None:
        guard_paths("/api", auth_error, protocol="ollama")

        @app.exception_handler(OllamaError)
        async def _ollama_error(_: Request, exc: OllamaError) -> Response:
            return error_response(exc)

        app.post("/api/chat")(self.chat)
        app.post("/api/generate")(self.generate)
        app.post("/api/embed")(self.embed)
        app.post("/api/embeddings")(self.embeddings)
        app.get("/api/tags")(self.tags)
        app.post("/api/show")(self.show)
        app.get("/api/ps")(self.ps)
        app.get("/api/version")(self.version)

    # ------------------------------------------------------------------ listing routes
    async def version(self) -> Response:
        return json_response(info.version())

    async def tags(self) -> Response:
        return json_response(info.tags(self.model))

    async def ps(self) -> Response:
        return json_response(info.ps(self.model))

    async def show(self, request: Request) -> Response:
        return json_response(info.show(await read_body(request), self.model, self.limits))

    async def embed(self, request: Request) -> Response:
        started = time.perf_counter_ns()
        req = parse_embed(await read_body(request), self.limits, legacy=False)
        if req.inputs:
            self._check_capacity()
        return json_response(await run_embed(self.engine, req, request, started))

    async def embeddings(self, request: Request) -> Response:
        started = time.perf_counter_ns()
        req = parse_embed(await read_body(request), self.limits, legacy=True)
        if req.inputs:
            self._check_capacity()
        return json_response(await run_embed(self.engine, req, request, started))

    # ------------------------------------------------------------------ generation routes
    async def chat(self, request: Request) -> Response:
        return await self._run(request, core.plan_chat)

    async def generate(self, request: Request) -> Response:
        return await self._run(request, core.plan_generate)

    def _check_capacity(self) -> None:
        waiting = self.engine.stats()["waiting"]
        if waiting >= self.max_queued:
            raise OllamaError(
                503,
                f"server busy, please try again: {waiting} requests are queued "
                f"(--max-queued {self.max_queued})",
                {"Retry-After": "1"},
            )

    async def _run(self, request: Request, make: Callable[[Any, ModelLimits], core.Request]) -> Response:
        started = time.perf_counter_ns()
        body = await read_body(request)
        self._check_capacity()  # before any template or grammar work
        planned = make(body, self.limits)
        reply = Reply(planned, started=started)
        plan = planned.plan
        if plan is None:
            return json_response(reply.final())
        peer = f"{request.client.host}:{request.client.port}" if request.client else None
        plan.choices[0][1].origin = Origin("ollama", planned.kind, peer)
        run = Execution(self.engine, plan)
        try:
            run.submit()
        except OpenAIError as exc:
            raise from_openai(exc) from None
        reply.submit()
        self.active.add(run)
        if planned.stream:
            return StreamingResponse(self._stream(run, reply), media_type=NDJSON)
        watcher = asyncio.create_task(watch_disconnect(request, run))
        try:
            async for batch in run.batches():
                for _, event in batch:
                    reply.feed(event)
        except OpenAIError as exc:
            raise from_openai(exc) from None
        finally:
            watcher.cancel()
            run.close()
            self.active.discard(run)
        return json_response(reply.final())

    async def _stream(self, run: Execution, reply: Reply) -> AsyncIterator[bytes]:
        """NDJSON; a client that goes away ends this generator, whose close cancels the engine
        request. An error after the status line was sent goes as a last `{"error": ...}` line
        (what Ollama's clients raise)."""
        try:
            async for batch in run.batches():
                lines = [line for _, event in batch if (line := reply.feed(event)) is not None]
                if lines:
                    yield b"".join(orjson.dumps(line) + b"\n" for line in lines)
            yield orjson.dumps(reply.final()) + b"\n"
        except OpenAIError as exc:
            yield orjson.dumps({"error": exc.message}) + b"\n"
        finally:
            run.close()
            self.active.discard(run)


def add_ollama_routes(
    app: FastAPI, engine: EngineAPI, limits: ModelLimits, active: set[Execution], max_queued: int = 256
) -> None:
    """Ollama's routes on `app` (the OpenAI API's, or --ollama-port's own)."""
    OllamaRoutes(engine, limits, active, max_queued).install(app)
