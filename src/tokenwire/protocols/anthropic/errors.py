"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.

The request is planned by the OpenAI side's core, which raises OpenAIError: from_openai keeps
its message and maps its status to the one Anthropic uses for that kind of failure (a server
that cannot take work now is Anthropic's 529 `overloaded_error`, which its clients retry).
"""

from __future__ import annotations

from typing import Any

from tokenwire.protocols.openai.errors import OpenAIError

# status -> Anthropic's error type (its documented table; other 4xx are invalid_request_error)
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class AnthropicError(Exception):
    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status in TYPES:
            return TYPES[self.status]
        return "invalid_request_error" if self.status < 500 else "api_error"

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


def from_openai(exc: OpenAIError) -> AnthropicError:
    """The OpenAI core's error for the same failure: its message (prefixed with the field it
    names, where the message does not start with it), Anthropic's status."""
    status = exc.status
    if status == 503:  # shutting down, a lost replica: Anthropic's "try again" status
        status = 529
    message = exc.message
    if exc.param and status == 400 and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return AnthropicError(status, message, headers=exc.headers)
