"""State of two opt-in extensions: named token buffers, and replay for retried streams."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import SessionNotFoundError
from tokenwire.protocols.lmtp.messages import RequestError, StreamId
from tokenwire.protocols.lmtp.streams import Stream

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

PROTOCOL = "lmtp"  # the engine sessions of kept buffers (claim_session's protocol)


class KeptBuffers:
    """Buffers kept past their connection (BUFFER or GENERATE with `"keep": true`): one registry
    for the server, by (owner, name), the owner the digest of the token the connection presented
    (protocols/security.py owner_of; "" without one). Each is an engine session claimed as an
    "lmtp" session with its name as metadata, so with --state-dir it outlives the server too: the
    registry is rebuilt from the engine's restored sessions on first use. A client reconnecting
    with the same token finds its kept buffers by name; another token does not."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], str] = {}  # (owner, name) -> engine session id
        self._restored = False

    def _restore(self, engine: EngineAPI) -> None:
        if self._restored:
            return
        self._restored = True
        claimed = getattr(engine, "claimed_sessions", None)
        for found in claimed(PROTOCOL) if claimed is not None else ():  # least recently used first
            meta, sid = found["metadata"], found["id"]
            name = meta.get("buffer")
            if not isinstance(name, str) or meta.get("session") != sid:
                engine.close_session(sid)  # a fork of a kept buffer (its metadata): a stream's, cut off
                continue
            old = self.sessions.get((found["owner"], name))
            self.sessions[(found["owner"], name)] = sid
            if old is not None:  # a crash between a replacement's commit and the old one's close
                engine.close_session(old)

    def get(self, engine: EngineAPI, owner: str, name: str) -> str | None:
        self._restore(engine)
        return self.sessions.get((owner, name))

    def put(self, engine: EngineAPI, owner: str, name: str, session: str) -> None:
        self._restore(engine)
        engine.claim_session(session, PROTOCOL, owner, {"buffer": name, "session": session})
        old = self.sessions.get((owner, name))
        self.sessions[(owner, name)] = session
        if old is not None and old != session:
            engine.close_session(old)

    def drop(self, engine: EngineAPI, owner: str, name: str) -> bool:
        self._restore(engine)
        session = self.sessions.pop((owner, name), None)
        if session is not None:
            engine.close_session(session)
        return session is not None


class Buffers:
    """Buffers extension: a connection's named token buffers, each an engine session (so its KV
    stays computed and requests that start from it fork it instead of recomputing). A name the
    connection does not hold is looked up among its owner's kept buffers (`kept`)."""

    def __init__(self, owner: str = "", kept: KeptBuffers | None = None) -> None:
        self.sessions: dict[str, str] = {}  # name -> engine session id
        self.owner = owner
        self.kept = kept

    def session(self, engine: EngineAPI, name: str) -> str:
        session = self.sessions.get(name)
        if session is None and self.kept is not None:
            session = self.kept.get(engine, self.owner, name)
        if session is None or not engine.has_session(session):
            raise RequestError(f"unknown buffer {name!r}", "unknown_buffer")
        return session

    def tokens(self, engine: EngineAPI, name: str) -> list[int]:
        try:
            return engine.session_tokens(self.session(engine, name))
        except SessionNotFoundError:
            raise RequestError(f"unknown buffer {name!r}", "unknown_buffer") from None

    def put(self, engine: EngineAPI, name: str, session: str, keep: bool = False) -> None:
        if keep and self.kept is not None:  # (stdio keeps nothing past its one client)
            old = self.sessions.pop(name, None)  # the kept one is the name's now
            self.kept.put(engine, self.owner, name, session)
        else:
            old = self.sessions.get(name)
            self.sessions[name] = session
        if old is not None and old != session:
            engine.close_session(old)

    def drop(self, engine: EngineAPI, name: str) -> bool:
        session = self.sessions.pop(name, None)
        if session is not None:
            engine.close_session(session)
            return True
        return self.kept is not None and self.kept.drop(engine, self.owner, name)

    def close(self, engine: EngineAPI | None) -> None:
        """The connection ends: its own buffers go (kept ones stay)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        if engine is not None:
            for session in sessions:
                engine.close_session(session)


class ReplayLog:
    """Retry extension: finished streams (their request and records), most recent last, so a
    resent request is answered from the log instead of generating again."""

    def __init__(self, limit: int = 256, max_records: int = 200_000) -> None:
        self.limit = limit
        self.max_records = max_records
        self.records_held = 0
        self.streams: OrderedDict[StreamId, Stream] = OrderedDict()

    def add(self, stream: Stream) -> None:
        self.forget(stream.stream_id)
        self.streams[stream.stream_id] = stream
        self.records_held += len(stream.sent or ())
        while len(self.streams) > self.limit or (
            self.records_held > self.max_records and len(self.streams) > 1
        ):
            _, old = self.streams.popitem(last=False)
            self.records_held -= len(old.sent or ())

    def find(self, sid: StreamId, fingerprint: str) -> Stream | None:
        stream = self.streams.get(sid)
        return stream if stream is not None and stream.fingerprint == fingerprint else None

    def forget(self, sid: StreamId) -> None:
        old = self.streams.pop(sid, None)
        if old is not None:
            self.records_held -= len(old.sent or ())

    def clear(self) -> None:
        self.streams.clear()
        self.records_held = 0

    @staticmethod
    def records(stream: Stream, resume_from: int) -> list[dict[str, Any]]:
        return list((stream.sent or [])[resume_from:])
