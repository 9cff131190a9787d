"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the HTTP status
each engine error maps to. Bad input is always a 4xx naming what was wrong; 5xx is kept for the
server's own failures (a model step that raised) and for a server that cannot take work now."""

from __future__ import annotations

from typing import Any

from tokenwire.engine.errors import (
    CapacityError,
    ContextOverflowError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    InvalidTokenError,
    KVBudgetError,
    PositionError,
    ReplicaLostError,
    SessionBusyError,
    SessionNotFoundError,
)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# engine error -> (status, type, code); the first match wins
_ENGINE: list[tuple[type[EngineError], int, str, str]] = [
    (SessionNotFoundError, 404, "not_found_error", "session_not_found"),
    (SessionBusyError, 409, "conflict_error", "session_busy"),
    (ContextOverflowError, 400, "invalid_request_error", "context_length_exceeded"),
    (CapacityError, 429, "rate_limit_error", "server_overloaded"),  # --max-sessions, --max-queued
    (KVBudgetError, 400, "invalid_request_error", "kv_budget_exceeded"),
    (InvalidTokenError, 400, "invalid_request_error", "invalid_token"),
    (PositionError, 400, "invalid_request_error", "invalid_position"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_value"),
    (ReplicaLostError, 503, "service_unavailable", "replica_lost"),  # --replicas: its replica died
    (EngineClosedError, 503, "service_unavailable", "shutting_down"),
]


def from_engine(exc: EngineError, param: str | None = None) -> OpenAIError:
    """The engine's message verbatim, with the status its kind of error deserves."""
    for cls, status, kind, code in _ENGINE:
        if isinstance(exc, cls):
            if cls is SessionNotFoundError:
                param = "session"
            return OpenAIError(status, str(exc), type=kind, param=param, code=code)
    return OpenAIError(500, str(exc), type="server_error", code="engine_error")


def model_not_found(requested: str, loaded: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"model {requested!r} is not served here: the loaded model is {loaded!r}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )
