"""The route module's I/O pieces without a server: the stream's named SSE framing and its
mid-stream `error` event, and the middleware that gives the app's shared errors (the body cap's
413, Starlette's 405) Anthropic's shape on /v1/messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tokenwire.engine.request import TokenEvent
from tokenwire.protocols.anthropic.routes import ErrorShapeMiddleware, MessagesRoutes
from tokenwire.protocols.openai.core import Plan
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.output import ChoiceOutput


class _FailingRun:
    """An Execution whose engine fails after one token (the server stopping: its 503)."""

    def __init__(self) -> None:
        out = ChoiceOutput(0, None, frozenset(), stops=[], ignore_eos=False, legacy_logprobs=False)  # type: ignore[arg-type]
        self.plan = Plan("chat", "m", None, [[1, 2]], [], [out], True, False, id="msg_1")
        self.closed = False

    async def batches(self) -> AsyncIterator[list[tuple[int, Any]]]:
        yield [(0, TokenEvent(5, 2, False, text="Hi"))]
        raise OpenAIError(503, "server shutting down", type="service_unavailable")

    def close(self) -> None:
        self.closed = True


class _Api:
    def __init__(self) -> None:
        self.active: set[Any] = set()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_failure_mid_stream_is_an_error_event_and_the_run_is_closed() -> None:
    run = _FailingRun()

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in MessagesRoutes(_Api())._stream(run)])  # type: ignore[arg-type]

    events = _events(asyncio.run(collect()))
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error",
    ]  # fmt: skip
    assert all(name == data["type"] for name, data in events)
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "server shutting down"},
    }
    assert run.closed


def _serve(path: str, status: int, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    asyncio.run(ErrorShapeMiddleware(inner)({"type": "http", "path": path}, receive, send))
    start, *bodies = sent
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in bodies)


OPENAI_413 = orjson.dumps(
    {"error": {"message": "request body over the limit", "type": "invalid_request_error"}}
)


def test_the_apps_shared_errors_take_anthropics_shape_on_its_paths() -> None:
    status, headers, body = _serve("/v1/messages", 413, OPENAI_413)
    expected = {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body over the limit"},
    }
    assert status == 413 and json.loads(body) == expected
    assert int(headers[b"content-length"]) == len(body)


def test_other_paths_and_successes_pass_unchanged() -> None:
    assert _serve("/v1/chat/completions", 413, OPENAI_413)[2] == OPENAI_413
    assert _serve("/v1/messages", 200, b'{"ok": 1}')[2] == b'{"ok": 1}'
    already = orjson.dumps({"type": "error", "error": {"type": "authentication_error", "message": "no"}})
    assert _serve("/v1/messages", 401, already)[2] == already
