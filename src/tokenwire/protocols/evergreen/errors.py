"""The one error form of an Evergreen session: an abort with a gRPC status code and a message
that names the node or action and the rule broken."""

from __future__ import annotations

import grpc


class SessionAbort(Exception):
    """Ends the session: the servicer turns it into the RPC's final status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"SessionAbort({self.code.name}, {self.message!r})"


def invalid(message: str) -> SessionAbort:
    return SessionAbort(grpc.StatusCode.INVALID_ARGUMENT, message)


def exhausted(message: str) -> SessionAbort:
    return SessionAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
