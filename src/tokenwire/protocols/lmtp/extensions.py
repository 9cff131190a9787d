"""State of two opt-in extensions: named token buffers, and replay for retried streams."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import SessionNotFoundError
from tokenwire.protocols.lmtp.messages import RequestError, StreamId
from tokenwire.protocols.lmtp.streams import Stream

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI


class Buffers:
    """Buffers extension: a connection's named token buffers, each an engine session (so its KV
    stays computed and requests that start from it fork it instead of recomputing)."""

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}  # name -> engine session id

    def session(self, engine: EngineAPI, name: str) -> str:
        session = self.sessions.get(name)
        if session is None or not engine.has_session(session):
            raise RequestError(f"unknown buffer {name!r}", "unknown_buffer")
        return session

    def tokens(self, engine: EngineAPI, name: str) -> list[int]:
        try:
            return engine.session_tokens(self.session(engine, name))
        except SessionNotFoundError:
            raise RequestError(f"unknown buffer {name!r}", "unknown_buffer") from None

    def put(self, engine: EngineAPI, name: str, session: str) -> None:
        old = self.sessions.get(name)
        self.sessions[name] = session
        if old is not None and old != session:
            engine.close_session(old)

    def drop(self, engine: EngineAPI, name: str) -> bool:
        session = self.sessions.pop(name, None)
        if session is not None:
            engine.close_session(session)
        return session is not None

    def close(self, engine: EngineAPI | None) -> None:
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
