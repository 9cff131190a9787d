"""Sessions over HTTP: the engine's own sessions (the store Salience serves too), by id.

A session keeps its tokens and their KV between requests; a chat or completion naming it
(`"session": id`) appends only its new part. Fork shares the parent's KV blocks up to `at`;
truncate rewinds. Every operation is one thread-safe engine call.

A session made with an API key (`Authorization: Bearer KEY` or `x-api-key`) belongs to that key:
with another key it answers as an unknown id does (404), before and after a restart (the owner,
a digest of the key, persists with the session: docs/sessions.md). One made without a key is
anyone's, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenwire.engine.errors import EngineError, SessionNotFoundError
from tokenwire.protocols.openai.core import check_model
from tokenwire.protocols.openai.errors import from_engine
from tokenwire.protocols.openai.schemas import SessionCreate, SessionFork, SessionTruncate
from tokenwire.protocols.security import http_owner

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def check_owner(engine: EngineAPI, session_id: str, request: Request) -> None:
    """SessionNotFoundError unless the session is the presenting key's (or nobody's)."""
    holder = engine.session_owner(session_id)
    if holder and holder != http_owner(request.headers):
        raise SessionNotFoundError(
            f"session {session_id!r} not found (closed, expired, never opened, or made with another API key)"
        )


def add_session_routes(app: FastAPI, engine: EngineAPI, limits: ModelLimits) -> None:
    def describe(session_id: str, full: bool) -> dict[str, Any]:
        tokens = engine.session_tokens(session_id)
        body: dict[str, Any] = {
            "id": session_id,
            "object": "session",
            "model": engine.name,
            "length": len(tokens),
        }
        if full:
            body["tokens"] = tokens
            body["text"] = engine.tokenizer.decode(tokens)
        return body

    def call(fn: Any, *args: Any, param: str | None = None) -> Any:
        try:
            return fn(*args)
        except EngineError as exc:
            raise from_engine(exc, param) from exc

    def owned(request: Request, session_id: str) -> None:
        call(check_owner, engine, session_id, request)

    @app.post("/v1/sessions")
    async def create_session(request: Request, body: SessionCreate | None = None) -> Response:
        """A new session, empty or holding `prompt` (text is tokenized as the model's tokenizer does)."""
        body = body or SessionCreate()
        check_model(body.model, limits)
        prompt = body.prompt
        tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        # no ttl given: the engine's own default (--session-ttl)
        args = (tokens,) if body.ttl is None else (tokens, body.ttl)
        sid = call(engine.create_session, *args, param="prompt")
        call(engine.claim_session, sid, "openai", http_owner(request.headers))  # persists, owned
        return _json(call(describe, sid, False))

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> Response:
        """Its length, tokens and their text."""
        owned(request, session_id)
        return _json(call(describe, session_id, True))

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork_session(session_id: str, request: Request, body: SessionFork | None = None) -> Response:
        """A new session with tokens [0, at) of this one, sharing its KV blocks (and its owner)."""
        owned(request, session_id)
        at = body.at if body is not None else None
        child = call(engine.fork_session, session_id, at, param="at")
        return _json(call(describe, child, False))

    @app.post("/v1/sessions/{session_id}/truncate")
    async def truncate_session(session_id: str, body: SessionTruncate, request: Request) -> Response:
        """Keep tokens [0, length): the next request continues from there."""
        owned(request, session_id)
        call(engine.truncate_session, session_id, body.length, param="length")
        return _json(call(describe, session_id, False))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> Response:
        """Close it (a running request on it is cancelled) and free its KV."""
        owned(request, session_id)
        if not engine.close_session(session_id):
            call(engine.session_tokens, session_id)  # raises the engine's not-found error
        return _json({"id": session_id, "object": "session.deleted", "deleted": True})
