"""What the server tells about itself: MODEL_INFO and HELLO answers, and error codes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import (
    CapacityError,
    ContextOverflowError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    InvalidTokenError,
    KVBudgetError,
    ReplicaLostError,
    SessionBusyError,
    SessionNotFoundError,
)
from tokenwire.protocols.lmtp.messages import EXTENSIONS

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

SERVER = "tokenwire"
SERVER_VERSION = "0.1.0"
_tokenizer_json: dict[int, str] = {}

# engine error -> (code, retryable)
_ENGINE_ERRORS: list[tuple[type[EngineError], str, bool]] = [
    (InvalidTokenError, "invalid_token", False),
    (InvalidRequestError, "invalid_field", False),
    (ContextOverflowError, "context_overflow", False),
    (CapacityError, "overloaded", True),  # --max-sessions, --max-queued
    (KVBudgetError, "kv_budget", True),
    (SessionNotFoundError, "unknown_buffer", False),
    (SessionBusyError, "busy", True),
    (ReplicaLostError, "replica_lost", True),  # --replicas: the session's replica died
    (EngineClosedError, "shutdown", True),
]


def engine_error_code(exc: EngineError) -> tuple[str, bool]:
    for cls, code, retryable in _ENGINE_ERRORS:
        if isinstance(exc, cls):
            return code, retryable
    return "engine_error", True


def eos_token_id(engine: EngineAPI) -> int | None:
    ids = engine.tokenizer.eos_token_ids or sorted(engine.eos_ids)
    return ids[0] if ids else None


def tokenizer_json(engine: EngineAPI) -> str:
    """The tokenizer's tokenizer.json text (cached: several MiB for large vocabularies)."""
    key = id(engine.tokenizer)
    if key not in _tokenizer_json:
        _tokenizer_json[key] = engine.tokenizer.hf.backend_tokenizer.to_str()
    return _tokenizer_json[key]


def model_info(engine: EngineAPI, data: dict[str, Any]) -> dict[str, Any]:
    tok = engine.tokenizer
    tokenizer: dict[str, Any] = {
        "type": "huggingface",
        "name_or_path": str(getattr(tok.hf, "name_or_path", "") or ""),
        "class": type(tok.hf).__name__,
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_ids": list(tok.eos_token_ids),
        "special_token_ids": sorted(tok.special_token_ids),
        "has_chat_template": tok.has_chat_template,
    }
    if data.get("tokenizer_json"):
        tokenizer["json"] = tokenizer_json(engine)
    return {
        "model": engine.name,
        "model_type": SERVER,
        "constructor": f"tokenwire engine ({engine.name})",
        "vocab_size": engine.vocab_size,
        "logits_size": engine.logits_size,
        "eos_token_id": eos_token_id(engine),
        "eos_token_ids": sorted(engine.eos_ids),
        "bos_token_id": tok.bos_token_id,
        "context_length": engine.max_model_len,
        "tokenizer": tokenizer,
        "server": SERVER,
        "version": SERVER_VERSION,
        "extensions": list(EXTENSIONS),
    }


def hello(engine: EngineAPI | None, enabled: set[str]) -> dict[str, Any]:
    return {
        "protocol": "lmtp",
        "server": SERVER,
        "version": SERVER_VERSION,
        "status": "ready" if engine is not None else "loading",
        "model": engine.name if engine is not None else None,
        "extensions": [e for e in EXTENSIONS if e in enabled],
        "available": list(EXTENSIONS),
    }
