"""The engine's session calls (engine.py's Engine inherits them): open, fork, truncate and
close sessions, and free their KV blocks, never under the feet of the step that runs."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenwire.engine.admission import check_tokens
from tokenwire.engine.errors import (
    CapacityError,
    EngineClosedError,
    PositionError,
    SessionBusyError,
    SessionNotFoundError,
)
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.kv_write_behind import WriteBehind
from tokenwire.engine.postprocess import Finish
from tokenwire.engine.request import Request
from tokenwire.engine.session import Session, Ttl
from tokenwire.engine.vision import SessionImage, check_cut

if TYPE_CHECKING:
    from tokenwire.engine.persistence import SessionPersistence
    from tokenwire.engine.scheduler import Scheduler

log = logging.getLogger("tokenwire.engine")


class SessionCalls:
    """What these calls read of the engine: its lock, sessions, requests and cache."""

    _lock: threading.RLock
    _sessions: dict[str, Session]
    _running: dict[str, Request]  # session id -> its unfinished request
    _stepping: set[str]
    _release_after_step: list[Session]
    _closed: bool
    kv: KVCache
    vocab_size: int
    max_sessions: int | None
    session_ttl_s: float | None
    _finish: Callable[[Request, Finish], None]  # the engine's: a request ends (close cancels it)
    state: SessionPersistence | None  # --state-dir (engine/persistence.py); None: sessions in RAM only
    scheduler: Scheduler
    source: Any
    weights: str | None
    device_type: str
    sessions_outlive_server: bool
    write_behind: WriteBehind | None  # idle sessions' KV to disk in the background

    def _open_state(self) -> None:
        """At start: the persisted sessions of this model back, and the hooks that keep them."""
        if self.state is None:
            return
        rows = self.state.open(self.source, self.weights, self.kv, self.device_type)
        for session in self.state.restore(rows, self.vocab_size):
            self._sessions[session.id] = session
        self.scheduler.spill = self._spill
        self.state.make_room = self._free_idle
        self.sessions_outlive_server = True  # a protocol stopping must not close them
        if self.state.files is not None:
            self.write_behind = WriteBehind(
                self.state, self._lock, self._idle_sessions, self._persisted_sessions, self._enforce_budget
            )

    def _persisted_sessions(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.protocol]

    def _spill(self, session: Session) -> None:
        """Must hold the lock: an idle session's KV leaves RAM, written to disk first."""
        assert self.state is not None
        if self.state.spill(session):
            self._enforce_budget()

    def _enforce_budget(self) -> None:
        assert self.state is not None
        self.state.enforce_budget(list(self._sessions.values()), set(self._running))

    def _free_idle(self) -> bool:
        """Must hold the lock, no step running: the least recently used idle session's KV to disk
        and out of RAM, for a block read back from disk (whether there was one to free)."""
        for session in self._idle_sessions():
            self._spill(session)
            session.release(self.kv)
            return True
        return False

    def _commit(self, session: Session) -> None:
        if self.state is not None:
            self.state.commit(session)

    def claim_session(
        self, session_id: str, protocol: str, owner: str = "", metadata: dict[str, Any] | None = None
    ) -> None:
        """A protocol's session by id: it persists (with --state-dir) and belongs to `owner`
        (a digest of the key that made it; "" for none). `metadata` (JSON), where given,
        replaces what the protocol keeps with it (a fork starts with its parent's)."""
        with self._lock:
            session = self._session(session_id)
            session.protocol, session.owner = protocol, owner
            if metadata is not None:
                session.metadata = metadata
            self._commit(session)

    def claimed_sessions(self, protocol: str | None = None) -> list[dict[str, Any]]:
        """The sessions `protocol` claimed (None: any protocol; those a restart restored
        included): each one's id, owner, metadata and idle seconds, least recently used first.
        How a protocol whose clients address its sessions by another name (Responses' response
        ids) finds them, and a restarted replica its sessions (scale/replica.py)."""
        with self._lock:
            now = time.monotonic()
            mine = [s for s in self._sessions.values() if s.protocol and protocol in (None, s.protocol)]
            mine.sort(key=lambda s: s.last_used)
            return [{"id": s.id, "owner": s.owner, "metadata": s.metadata, "idle_s": now - s.last_used}
                    for s in mine]  # fmt: skip

    def session_owner(self, session_id: str) -> str:
        """Who a session belongs to ("" for nobody in particular); SessionNotFoundError if gone."""
        with self._lock:
            return self._session(session_id).owner

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is shut down")

    def create_session(self, tokens: Sequence[int] = (), ttl_s: float | Ttl | None = Ttl.DEFAULT) -> str:
        """A new session holding `tokens`; it expires after `ttl_s` idle seconds (None: never)."""
        check_tokens(tokens, self.vocab_size, "tokens")
        with self._lock:
            self._check_open()
            self._check_session_room()
            sid = uuid.uuid4().hex
            ttl = self.session_ttl_s if ttl_s is Ttl.DEFAULT else ttl_s
            self._sessions[sid] = Session(sid, tokens=list(tokens), ttl_s=ttl)
            return sid

    def _check_session_room(self) -> None:
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            raise CapacityError(
                f"too many open sessions: {len(self._sessions)} (--max-sessions {self.max_sessions}); "
                "close some or retry later"
            )

    def close_session(self, session_id: str) -> bool:
        """Close a session, cancelling its request. Returns False if it did not exist."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return False
            request = self._running.get(session_id)
            if request is not None:
                self._finish(request, Finish("cancelled"))
            self._release(session)
            if self.state is not None:
                self.state.forget(session)
                if self.write_behind is not None and session.protocol:
                    self.write_behind.poke()  # its files may go (kv_write_behind.py)
            return True

    def _release(self, session: Session) -> None:
        """Must hold the lock. Free a closed session's KV blocks, after the step if it is in it."""
        if session.id in self._stepping:
            self._release_after_step.append(session)
        else:
            session.release(self.kv)

    def _step_over(self) -> None:
        """Must hold the lock: the step ended; free what was closed during it."""
        self._stepping = set()
        released, self._release_after_step = self._release_after_step, []
        for session in released:
            session.release(self.kv)

    def fork_session(self, session_id: str, at: int | None = None) -> str:
        with self._lock:
            src = self._session(session_id)
            self._check_session_room()
            at = len(src.tokens) if at is None else at
            if not 0 <= at <= len(src.tokens):
                raise PositionError(f"cannot fork at position {at}: session has {len(src.tokens)} tokens")
            check_cut(src.images, at, "fork")
            child = src.fork(uuid.uuid4().hex, at, self.kv)
            self._sessions[child.id] = child
            self._commit(child)
            return child.id

    def truncate_session(self, session_id: str, length: int) -> None:
        with self._lock:
            session = self._session(session_id)
            self._check_idle(session_id)
            if not 0 <= length <= len(session.tokens):
                raise PositionError(f"cannot truncate to {length}: session has {len(session.tokens)} tokens")
            check_cut(session.images, length, "truncate")
            session.truncate(length, self.kv)
            self._commit(session)

    def session_tokens(self, session_id: str) -> list[int]:
        with self._lock:
            return list(self._session(session_id).tokens)

    def session_images(self, session_id: str) -> list[SessionImage]:
        """The image blocks a session holds (vision models), by position."""
        with self._lock:
            return list(self._session(session_id).images)

    def session_busy(self, session_id: str) -> bool:
        with self._lock:
            self._session(session_id)
            return session_id in self._running

    def touch_session(self, session_id: str) -> None:
        with self._lock:
            self._session(session_id).touch()

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def _idle_sessions(self) -> list[Session]:
        """Sessions holding KV with no request running, least recently used first."""
        idle = [s for s in self._sessions.values() if s.id not in self._running and s.block_table]
        return sorted(idle, key=lambda s: s.last_used)

    def _reap_idle(self) -> None:
        now = time.monotonic()
        for session in list(self._sessions.values()):
            idle = session.id not in self._running
            if session.ttl_s is not None and idle and now - session.last_used > session.ttl_s:
                log.info("session %s expired after %.0fs idle", session.id, session.ttl_s)
                self.close_session(session.id)

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id!r} not found (closed, expired or never opened)")
        return session

    def _check_idle(self, session_id: str) -> None:
        if session_id in self._running:
            raise SessionBusyError(f"session {session_id} has a request running")
