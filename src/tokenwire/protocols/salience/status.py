"""gRPC status codes of Salience errors, and the mapping of engine errors onto them."""

from __future__ import annotations

import grpc

from tokenwire.engine.errors import (
    ContextOverflowError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    InvalidTokenError,
    KVBudgetError,
    PositionError,
    SessionBusyError,
    SessionNotFoundError,
)


class SalienceStatus(Exception):
    """A request the service refuses: the status code and message the client receives."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"SalienceStatus({self.code.name}, {self.message!r})"


# Most specific first: several engine errors share Python base classes (ValueError, KeyError).
_ENGINE_CODES: list[tuple[type[EngineError], grpc.StatusCode]] = [
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SessionBusyError, grpc.StatusCode.ABORTED),
    (ContextOverflowError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (KVBudgetError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PositionError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidTokenError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineClosedError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(error: EngineError) -> SalienceStatus:
    """The gRPC status an engine error becomes; the engine's message names what was wrong."""
    for kind, code in _ENGINE_CODES:
        if isinstance(error, kind):
            return SalienceStatus(code, str(error))
    return SalienceStatus(grpc.StatusCode.INTERNAL, f"engine error: {error}")
