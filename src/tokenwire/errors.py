"""The errors the model layer raises for a caller's mistake, at the bottom so that model/ and
engine/ can both raise them. engine/errors.py re-exports them with the engine's other errors;
callers import them from there."""


class EngineError(Exception):
    """Base class for errors the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request option out of range (negative max_tokens, bad top_p, ...)."""
