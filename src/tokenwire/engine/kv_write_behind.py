"""Idle sessions' KV written to block files in the background (write-behind), and the block
files no session holds any more removed.

Without it a persisted session's KV reached disk only when the scheduler took its RAM for
another request (which then waited for the write: 47 MB for a 2k-token SmolLM2 history, 64 MB
at Llama-3.2-1B's widths) or at SIGTERM, and a SIGKILL lost the KV of every session still in RAM
(their next turns computed it again from their tokens). Now a persisted session idle for
WRITE_AFTER_IDLE_S has the blocks it holds that are not on disk yet (its full blocks, and the
partial one at its computed end: persistence.py `stored_blocks`) written by one thread,
CHUNK_BLOCKS at a time: under the engine lock it picks the blocks (least recently used session
first) and takes a reference on each, so none is freed or reused while it is copied; without
the lock it copies and writes them (the copy, the checksum and the file write release the GIL);
under the lock again it indexes the files and drops the references. A session the scheduler
evicts later only drops its RAM (engine/persistence.py `spill` finds its blocks on disk).

The thread runs at nice +10: on two cores a step's threads come first, and the writes use what
the steps leave (the engine is mostly idle between a user's turns).

Near --state-max-gb (over 90%) nothing is written here: the scheduler's eviction writes what it
evicts and the bound removes the least recently used sessions' files, as without this thread.

Files: content-addressed and written once; with every persisted session written, the files of
closed sessions, and each turn's older partial block, would stay for ever (--state-max-gb is
unbounded by default), so after either, at most every GC_EVERY_S, the files no open persisted
session holds (persistence.py `held`) are removed (at start too: a crash may have left some).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenwire.engine.kv_disk_layout import read_block

if TYPE_CHECKING:
    from tokenwire.engine.persistence import SessionPersistence
    from tokenwire.engine.session import Session

log = logging.getLogger("tokenwire.state")

WRITE_AFTER_IDLE_S = 0.5  # a turn's end to its session's write: a client's next turn comes sooner
CHUNK_BLOCKS = 16  # blocks a lock hold picks (16 SmolLM2 blocks: 5.9 MB, a few ms to write)
GC_EVERY_S = 2.0  # a collection holds the lock ~2 ms for 200 sessions of 2k tokens (chains cached)
NICE = 10
REFUSED_PAUSE_S = 30.0  # after the disk refused a write (full): wait before trying again


class WriteBehind:
    def __init__(
        self,
        state: SessionPersistence,
        lock: threading.RLock,
        idle_sessions: Callable[[], list[Session]],
        persisted_sessions: Callable[[], list[Session]],
        after_writes: Callable[[], None],
    ) -> None:
        """`idle_sessions`: sessions holding KV with no request, least recently used first;
        `persisted_sessions`: the open sessions a protocol claimed; `after_writes`: the
        --state-max-gb check. All three are called holding `lock`, the engine's."""
        assert state.files is not None
        self.state, self.files, self.kv = state, state.files, state.kv
        self._lock = lock
        self._idle_sessions = idle_sessions
        self._persisted = persisted_sessions
        self._after_writes = after_writes
        self._done: dict[str, tuple[int, bytes]] = {}  # session -> (blocks, last hash) all on disk
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._orphaning_seen = -1  # state.orphaning at the last collection (-1: once at start)
        self._next_gc = 0.0
        self._thread = threading.Thread(target=self._run, name="tokenwire-kv-write", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """A turn ended (or a session closed): look again after WRITE_AFTER_IDLE_S."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the thread after the chunk in flight (at shutdown, before the final flush)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:  # this thread only (Linux: a thread id is a process id to setpriority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):  # no per-thread priority here: it runs at the default
            pass
        wait: float | None = 0.0
        while not self._stop.is_set():
            if wait != 0.0:
                self._wake.wait(wait)
                self._wake.clear()
                if self._stop.is_set():
                    return
            try:
                wait = self._once()
            except Exception:  # a bug here must not end persistence for the process's lifetime
                log.exception("KV write-behind failed; retrying in %.0f s", REFUSED_PAUSE_S)
                wait = REFUSED_PAUSE_S

    def _once(self) -> float | None:
        """One chunk written, or garbage collected; how long to wait before the next look (0:
        at once; None: until poked)."""
        with self._lock:
            collect_at = self._collect_garbage()
            job, due = self._pick()
        if not job:
            due = min((t for t in (due, collect_at) if t is not None), default=None)
            return None if due is None else max(0.01, due - time.monotonic())
        sizes: list[int | None] = []
        for digest, block in job:
            if self._stop.is_set():  # shutdown: the flush writes what is left
                sizes.append(None)
                continue
            sizes.append(self.files.store(digest, read_block(self.kv, block), ".tmp-wb"))
        with self._lock:
            for (digest, block), size in zip(job, sizes, strict=True):
                self.kv.allocator.decref(block)
                self.state.writing.discard(digest)
                if size is not None:
                    self.files.index(digest, size)
            self._after_writes()
        return REFUSED_PAUSE_S if None in sizes and not self._stop.is_set() else 0.0

    def _pick(self) -> tuple[list[tuple[bytes, int]], float | None]:
        """Must hold the lock. Up to CHUNK_BLOCKS (hash, block) of idle persisted sessions, not
        on disk, each with a reference taken; and when the next session becomes due."""
        now = time.monotonic()
        job: list[tuple[bytes, int]] = []
        files, writing, allocator = self.files, self.state.writing, self.kv.allocator
        bound = self.state.max_bytes
        if bound is not None and files.bytes_total > bound * 0.9:
            # near --state-max-gb each write would evict an idle session's files (least recently
            # used: often the very one just written); the scheduler's eviction writes instead
            return job, None
        for session in self._idle_sessions():  # least recently used first
            if not session.protocol or session.images:
                continue
            blocks, tail = self.state.stored_blocks(session)
            marker = (len(blocks), blocks[-1][0]) if blocks else None
            if marker is None or self._done.get(session.id) == marker:
                continue
            if now - session.last_used < WRITE_AFTER_IDLE_S:
                return job, session.last_used + WRITE_AFTER_IDLE_S  # the rest are more recent
            todo = self.state.unwritten(blocks, tail)
            if len(todo) <= CHUNK_BLOCKS - len(job):
                self._done[session.id] = marker
            for digest, block in todo[: CHUNK_BLOCKS - len(job)]:
                allocator.incref(block)
                writing.add(digest)
                job.append((digest, block))
            if len(job) >= CHUNK_BLOCKS:
                break
        return job, None

    def _collect_garbage(self) -> float | None:
        """Must hold the lock. The block files no open persisted session holds, removed (after
        a session closed or a partial block was written anew, at most every GC_EVERY_S); when
        it is due next (None: nothing since)."""
        orphaning = self.state.orphaning
        if orphaning == self._orphaning_seen:
            return None
        if time.monotonic() < self._next_gc:
            return self._next_gc
        self._orphaning_seen, self._next_gc = orphaning, time.monotonic() + GC_EVERY_S
        sessions = self._persisted()
        open_ids = {s.id for s in sessions}
        for sid in [sid for sid in self._done if sid not in open_ids]:
            del self._done[sid]
        held: set[bytes] = set(self.state.writing)
        for session in sessions:
            held.update(self.state.held(session))
        stale = [d for d in self.files.sizes if d not in held and not self.state.reading(d)]
        for digest in stale:
            self.files.remove(digest)
        if stale:
            log.info("KV block files: %d no open session holds removed", len(stale))
        return None
