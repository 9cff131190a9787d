"""Sessions over HTTP: the engine's own sessions (the store Salience serves too), by id.

A session keeps its tokens and their KV between requests; a chat or completion naming it
(`"session": id`) appends only its new part. Fork shares the parent's KV blocks up to `at`;
truncate rewinds. Every operation is one thread-safe engine call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response

from tokenwire.engine.errors import EngineError
from tokenwire.protocols.openai.core import check_model
from tokenwire.protocols.openai.errors import from_engine
from tokenwire.protocols.openai.schemas import SessionCreate, SessionFork, SessionTruncate

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


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

    @app.post("/v1/sessions")
    async def create_session(body: SessionCreate | None = None) -> Response:
        """A new session, empty or holding `prompt` (text is tokenized as the model's tokenizer does)."""
        body = body or SessionCreate()
        check_model(body.model, limits)
        prompt = body.prompt
        tokens = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        # no ttl given: the engine's own default (--session-ttl)
        args = (tokens,) if body.ttl is None else (tokens, body.ttl)
        sid = call(engine.create_session, *args, param="prompt")
        return _json(call(describe, sid, False))

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> Response:
        """Its length, tokens and their text."""
        return _json(call(describe, session_id, True))

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork_session(session_id: str, body: SessionFork | None = None) -> Response:
        """A new session with tokens [0, at) of this one, sharing its KV blocks."""
        at = body.at if body is not None else None
        child = call(engine.fork_session, session_id, at, param="at")
        return _json(call(describe, child, False))

    @app.post("/v1/sessions/{session_id}/truncate")
    async def truncate_session(session_id: str, body: SessionTruncate) -> Response:
        """Keep tokens [0, length): the next request continues from there."""
        call(engine.truncate_session, session_id, body.length, param="length")
        return _json(call(describe, session_id, False))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> Response:
        """Close it (a running request on it is cancelled) and free its KV."""
        if not engine.close_session(session_id):
            call(engine.session_tokens, session_id)  # raises the engine's not-found error
        return _json({"id": session_id, "object": "session.deleted", "deleted": True})
