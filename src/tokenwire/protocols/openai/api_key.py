"""The API key on the HTTP port, for every API served there (OpenAI's, Anthropic's, Ollama's,
the tokenizer endpoints): which path prefixes it guards and each one's 401 in its API's own
error shape. A module of its own, below transport.py, so the APIs register their prefixes
without importing the server that imports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi.responses import Response

from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.security import bearer, refused, token_matches

# Paths the API key guards on this port, longest prefix first when a request is refused: each
# API answers a missing key in its own error shape (OpenAI's by default). The APIs served
# beside OpenAI's (Anthropic, Ollama, the tokenizer endpoints) add theirs with guard_paths().
AuthErrorShape = Callable[[str], Response]
_GUARDED: dict[str, tuple[AuthErrorShape, str]] = {}  # prefix -> (its 401, its access-log protocol)


def _openai_auth_error(message: str) -> Response:
    error = OpenAIError(401, message, type="authentication_error", code="invalid_api_key")
    return Response(orjson.dumps(error.body()), status_code=401, media_type="application/json")


def guard_paths(prefix: str, shape: AuthErrorShape | None = None, protocol: str = "openai") -> None:
    """Require the API key on paths starting with `prefix`, refused in `shape` (a 401 in that
    API's own error form; OpenAI's when None) and logged as `protocol`'s refusal."""
    _GUARDED[prefix] = (shape or _openai_auth_error, protocol)


guard_paths("/v1")


class ApiKeyMiddleware:
    """The API key on every guarded route (guard_paths: /v1 and the other APIs' prefixes), as
    `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`. Plain ASGI: Starlette's
    BaseHTTPMiddleware would pipe every streamed chunk through an extra memory stream."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        guard = _guard_for(scope["path"]) if scope["type"] == "http" else None
        if guard is not None:
            shape, protocol = guard
            headers = dict(scope["headers"])
            given = bearer(headers.get(b"authorization"))
            if given is None and b"x-api-key" in headers:
                given = headers[b"x-api-key"].decode("latin-1").strip()
            if not token_matches(self.api_key, given):
                client = scope.get("client")
                refused(protocol, client[0] if client else None, scope["path"], given)
                message = "missing or wrong API key: send Authorization: Bearer <key> (or x-api-key: <key>)"
                await shape(message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guard_for(path: str) -> tuple[AuthErrorShape, str] | None:
    best = max((prefix for prefix in _GUARDED if path.startswith(prefix)), key=len, default=None)
    return None if best is None else _GUARDED[best]
