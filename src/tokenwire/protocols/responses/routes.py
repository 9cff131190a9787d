"""The Responses API's routes on the OpenAI app (`--http-port`): thin, over core.py's values.

A stored response owns an engine session holding its whole conversation (KV included): a
request with `previous_response_id` forks that session (sharing its KV blocks, copy on write)
and appends only its new input, so the earlier turns are not computed again and the previous
response stays continuable (branching). `store: false` runs on a throwaway fork (or on no
session without previous_response_id) that is closed with the request. Engine work goes
through chat's runner (Execution), labelled Origin("openai", "responses", peer); a client that
goes away cancels the request and closes its session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from tokenwire.engine.errors import CapacityError, EngineError
from tokenwire.engine.request import Origin
from tokenwire.protocols.openai.errors import OpenAIError, bad_request, from_engine
from tokenwire.protocols.openai.runner import Execution, watch_disconnect
from tokenwire.protocols.responses.core import Turn, finish, plan_turn, response_object
from tokenwire.protocols.responses.events import EventStream, sse
from tokenwire.protocols.responses.schemas import ResponseCreate
from tokenwire.protocols.responses.store import DEFAULT_CAPACITY, ResponseStore, Stored, not_found
from tokenwire.protocols.security import http_owner

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits

log = logging.getLogger("tokenwire.openai")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIApp(Protocol):
    """What these routes use of the OpenAI app (transport.OpenAIApp), named here so that this
    module does not import the transport that imports it."""

    engine: EngineAPI
    app: FastAPI
    limits: ModelLimits
    active: set[Execution]  # running requests, aborted when the server stops

    def _check_capacity(self) -> None: ...


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def _owner(request: Request) -> str:
    return http_owner(request.headers)


def store_for(api: OpenAIApp) -> ResponseStore:
    """Bounded by the engine's own session limits: half of --max-sessions (the other half stays
    for the other protocols' sessions), forgotten after --session-ttl idle, as their sessions are."""
    engine = api.engine
    most = getattr(engine, "max_sessions", None)
    capacity = max(1, most // 2) if isinstance(most, int) else DEFAULT_CAPACITY
    ttl = getattr(engine, "session_ttl_s", 1800.0)
    return ResponseStore(capacity, ttl, lambda session: engine.close_session(session))


def add_responses_routes(api: OpenAIApp) -> ResponseStore:
    engine, app = api.engine, api.app
    store = store_for(api)

    def open_session(source: Stored | None, keep: bool) -> str | None:
        """This response's session: a fork of the previous one's, a new one to store, or none.
        At --max-sessions the least recently used stored response makes room."""
        if source is None and not keep:
            return None
        for attempt in (0, 1):
            try:
                if source is not None:
                    return engine.fork_session(source.session or "")
                return engine.create_session()
            except CapacityError as exc:
                if attempt or not store.evict_oldest(keep=source.id if source else None):
                    raise from_engine(exc) from exc
            except EngineError as exc:
                raise from_engine(exc) from exc
        return None  # unreachable

    def settle(turn: Turn, owner: str, session: str | None, ok: bool) -> None:
        """A finished response is stored with its session; any other ends with its session closed."""
        if ok and turn.body.store and session is not None:
            response = response_object(turn)
            store.put(Stored(turn.id, owner, session, response, [*turn.history, *turn.items]))
        elif session is not None:
            engine.close_session(session)

    def lookup(response_id: str, request: Request) -> Stored:
        """This key's stored response, its session kept alive; a response whose session expired
        is forgotten (404)."""
        stored = store.get(response_id, _owner(request))
        try:
            engine.touch_session(stored.session or "")
        except EngineError:
            store.forget(response_id)
            raise not_found(response_id) from None
        return stored

    @app.post("/v1/responses")
    async def create_response(body: ResponseCreate, request: Request) -> Response:
        """OpenAI's Responses API: a response to `input`, optionally continuing a stored one."""
        api._check_capacity()
        owner = _owner(request)
        previous, tokens, history = None, None, []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, owner, "previous_response_id")
            try:
                tokens = engine.session_tokens(previous.session or "")
                engine.touch_session(previous.session or "")
            except EngineError:
                store.forget(previous.id)  # its session expired or was closed
                raise not_found(previous.id, "previous_response_id") from None
            history = previous.chain()
        turn = plan_turn(body, api.limits, previous.response if previous else None, history, tokens)
        session = open_session(previous, body.store)
        plan = turn.plan
        plan.session = session
        peer = f"{request.client.host}:{request.client.port}" if request.client else None
        plan.choices[0][1].origin = Origin("openai", "responses", peer)
        run = Execution(engine, plan)
        try:
            run.submit()
        except BaseException:
            settle(turn, owner, session, ok=False)
            raise
        api.active.add(run)
        if body.stream:
            stream = _stream(api, run, turn, lambda ok: settle(turn, owner, session, ok))
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        watcher = asyncio.create_task(watch_disconnect(request, run))
        ok = False
        try:
            async for batch in run.batches():
                for _, event in batch:
                    turn.out.feed(event)
            finish(turn)
            ok = turn.out.finish is not None and turn.out.finish.reason != "cancelled"
        finally:
            watcher.cancel()
            run.close()
            api.active.discard(run)
            settle(turn, owner, session, ok)
        return _json(response_object(turn))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        """A stored response (this API key's)."""
        return _json(lookup(response_id, request).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        """Forget a stored response and close its session."""
        store.delete(response_id, _owner(request))
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        limit: int = Query(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> Response:
        """The items a stored response was made from, earlier turns' included (newest first by
        default), a page at a time (`after`: the last id of the page before)."""
        items = lookup(response_id, request).items
        ordered = items[::-1] if order == "desc" else list(items)
        start = 0
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise bad_request(f"after: no item {after!r} in this response's input items", "after")
            start = ids.index(after) + 1
        page = ordered[start : start + limit]
        return _json(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(ordered),
            }
        )

    return store


async def _stream(api: OpenAIApp, run: Execution, turn: Turn, settle: Any) -> AsyncIterator[bytes]:
    """The events of a streamed response; a client that goes away stops this generator, which
    cancels the engine request and closes the session at once."""
    events = EventStream(turn)
    ok = False
    try:
        yield b"".join(sse(e) for e in events.start())
        try:
            async for batch in run.batches():
                chunk = [e for _, event in batch for e in events.text(turn.out.feed(event).text)]
                if chunk:
                    yield b"".join(sse(e) for e in chunk)
            closing = events.end()
            ok = True
            settle(True)  # stored before response.completed goes out: a client may continue at once
            yield b"".join(sse(e) for e in closing)
        except OpenAIError as exc:
            yield b"".join(sse(e) for e in events.failed(exc))
        except Exception:  # the status line is sent: a failure of ours still ends as OpenAI's events
            log.exception("a streamed response failed")
            failure = OpenAIError(500, "internal error while streaming the response", type="server_error")
            yield b"".join(sse(e) for e in events.failed(failure))
    finally:
        run.close()
        api.active.discard(run)
        if not ok:
            settle(False)
