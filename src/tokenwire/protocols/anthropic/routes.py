"""Anthropic's Messages API as FastAPI routes on the OpenAI API's app (--http-port).

The routes read their body themselves (request.json() validated against schemas.py in
core.parse) instead of taking it as a FastAPI body parameter: FastAPI's validation errors go to
the app-wide handler, which answers in OpenAI's shape. Every failure here is an AnthropicError,
answered by this module's own handler (and as an `error` event once a stream has begun).

The engine side is the OpenAI API's: the same Execution (admission, cancellation, the
server-stop abort through OpenAIApp.active), with the requests labelled
Origin("anthropic", "messages", peer) for /metrics and the access log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tokenwire.engine.request import Origin
from tokenwire.protocols.anthropic import core
from tokenwire.protocols.anthropic.errors import AnthropicError, from_openai, invalid
from tokenwire.protocols.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenwire.protocols.openai.core import ModelLimits
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.runner import Execution, watch_disconnect

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

PREFIX = "/v1/messages"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


class Host(Protocol):
    """What these routes use of the OpenAI API's app (transport.OpenAIApp), named here rather
    than imported: transport imports this module to install it."""

    engine: EngineAPI
    limits: ModelLimits
    active: set[Execution]  # running requests, aborted when the server stops

    def _check_capacity(self) -> None: ...


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error_response(exc: AnthropicError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


def _auth_error(message: str) -> Response:
    """A missing or wrong key (the shared --api-key, as x-api-key or Bearer) in this API's shape."""
    return _error_response(AnthropicError(401, message))


def _sse(event: dict[str, Any]) -> bytes:
    """One named event, as Anthropic sends them (`event:` then its JSON with the same type)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


class MessagesRoutes:
    def __init__(self, api: Host) -> None:
        self.api = api

    async def count_tokens(self, request: Request) -> Response:
        req = core.parse(CountTokensRequest, await _body(request))
        return _json({"input_tokens": core.count_tokens(req, self.api.limits)})

    async def messages(self, request: Request) -> Response:
        req = core.parse(MessagesRequest, await _body(request))
        try:
            self.api._check_capacity()  # the same --max-queued 429 as the OpenAI routes
        except OpenAIError as exc:
            raise from_openai(exc) from None
        plan = core.plan_messages(req, self.api.limits)
        peer = f"{request.client.host}:{request.client.port}" if request.client else None
        for _, options in plan.choices:
            options.origin = Origin("anthropic", "messages", peer)
        run = Execution(self.api.engine, plan)
        try:
            run.submit()
        except OpenAIError as exc:
            raise from_openai(exc) from None
        self.api.active.add(run)  # aborted with a 503 (here: 529 overloaded) when the server stops
        if req.stream:
            return StreamingResponse(self._stream(run), media_type="text/event-stream", headers=SSE_HEADERS)
        watcher = asyncio.create_task(watch_disconnect(request, run))
        try:
            async for batch in run.batches():
                for index, event in batch:
                    plan.outputs[index].feed(event)
        except OpenAIError as exc:
            raise from_openai(exc) from None
        finally:
            watcher.cancel()
            run.close()
            self.api.active.discard(run)
        return _json(core.message_response(plan))

    async def _stream(self, run: Execution) -> AsyncIterator[bytes]:
        """Named SSE events; a client that goes away ends this generator (Starlette), and
        closing the run cancels the engine request at once."""
        stream = core.EventStream(run.plan)
        try:
            yield b"".join(_sse(e) for e in stream.start())
            async for batch in run.batches():
                chunk = b"".join(_sse(e) for _, event in batch for e in stream.feed(event))
                if chunk:
                    yield chunk
        except OpenAIError as exc:  # the status line is sent: the error goes as an event
            yield _sse(core.error_event(from_openai(exc)))
        finally:
            run.close()
            self.api.active.discard(run)


class ErrorShapeMiddleware:
    """Errors answered before or around these routes by the app's shared parts (the body cap's
    413, Starlette's 404/405, FastAPI's app-wide handlers) are in OpenAI's shape: on
    /v1/messages they are rewritten into Anthropic's. Plain ASGI; only error responses (small,
    never streamed) are buffered, everything else passes as it comes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def shaped_send(message: Any) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = _reshaped(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaped_send)


def _reshaped(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's (its message kept); others unchanged."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(parsed, dict) or parsed.get("type") == "error":  # already Anthropic's
        return body
    error = parsed.get("error")
    if not isinstance(error, dict):
        return body
    return orjson.dumps(AnthropicError(status, str(error.get("message", ""))).body())


def add_anthropic_routes(app: FastAPI, api: Host, guard_paths: Callable[..., None]) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on the OpenAI API's app (issue 43);
    `guard_paths`: transport's, so the API key refuses these paths in Anthropic's shape."""
    guard_paths(PREFIX, _auth_error, protocol="anthropic")
    routes = MessagesRoutes(api)

    @app.exception_handler(AnthropicError)
    async def _anthropic_error(_: Request, exc: AnthropicError) -> Response:
        return _error_response(exc)

    # added after the app's own middleware, so outermost: it sees the body cap's 413 too
    app.add_middleware(ErrorShapeMiddleware)
    app.post("/v1/messages")(routes.messages)
    app.post("/v1/messages/count_tokens")(routes.count_tokens)
