"""Engine errors. Each names what was wrong so protocols can pass the message on verbatim."""

# the two the model raises too live below both (tokenwire/errors.py); they are the engine's errors
from tokenwire.errors import EngineError, InvalidRequestError

__all__ = [
    "CapacityError",
    "ContextOverflowError",
    "EngineClosedError",
    "EngineError",
    "InvalidRequestError",
    "InvalidTokenError",
    "KVBudgetError",
    "PositionError",
    "ReplicaLostError",
    "SessionBusyError",
    "SessionNotFoundError",
]


class InvalidTokenError(EngineError, ValueError):
    """A token id outside the model's vocabulary."""


class ContextOverflowError(EngineError):
    """The sequence would be longer than the model's context."""


class SessionNotFoundError(EngineError, KeyError):
    """Unknown, closed or expired session."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class SessionBusyError(EngineError):
    """The session already has a request running."""


class PositionError(EngineError, ValueError):
    """Truncate or fork past the end of a session."""


class KVBudgetError(EngineError):
    """The request cannot fit in the KV cache budget."""


class CapacityError(KVBudgetError):
    """A configured capacity is full (--max-sessions, --max-queued): refused now, retry later.
    A KVBudgetError, so every protocol answers it as a resource limit."""


class EngineClosedError(EngineError):
    """The engine has shut down."""


class ReplicaLostError(EngineClosedError):
    """The engine replica holding a session died (--replicas): its KV is gone; the session must
    be opened again (a new one is placed on a live replica)."""
