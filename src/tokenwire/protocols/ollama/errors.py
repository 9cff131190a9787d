"""Ollama's error shape, `{"error": "..."}`, with the status each failure deserves: 4xx for
whatever the client got wrong, 5xx only for the server's own failures or unavailability."""

from __future__ import annotations

from typing import Any

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import InvalidValueError
from tokenwire.protocols.openai.errors import OpenAIError, from_engine


class OllamaError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


def bad_request(message: str) -> OllamaError:
    return OllamaError(400, message)


def from_openai(exc: OpenAIError) -> OllamaError:
    """The shared machinery (chat templates, grammars, the runner) raises OpenAI's errors: the
    same status and message, in Ollama's shape."""
    return OllamaError(exc.status, exc.message, exc.headers)


def from_engine_error(exc: EngineError) -> OllamaError:
    """An engine error with the status the OpenAI API gives it; a value the engine's numeric
    rules refused names the Ollama field (`options.temperature`)."""
    if isinstance(exc, InvalidValueError):
        return OllamaError(400, str(exc))
    return from_openai(from_engine(exc))


def model_not_found(requested: str) -> OllamaError:
    """Ollama's own words for a model it does not have."""
    return OllamaError(404, f'model "{requested}" not found, try pulling it first')
