"""The session store: every persisted session's row in SQLite (the standard library's sqlite3).

One file, `<state dir>/sessions.db`, in WAL mode with synchronous=NORMAL: a commit is in the
log before the call returns, so a SIGKILL loses only what was never committed (a turn in
flight); only a power cut can lose the last commits (the log is not fsynced per commit). Each
row holds a session's id, the model file it belongs to (`model`: sessions of another model are
left alone, engine/persistence.py), protocol, owner (a digest of the key that made it), token
list (int32 little-endian, with its CRC32), fork parent, TTL, last use (wall clock, so a TTL
runs across restarts) and metadata (JSON).

A damaged file never stops a start: `open_store` reads what rows it can (a truncated file
or a bad page ends the scan; a row whose token CRC is wrong is skipped), moves the damaged
file aside as sessions.db.damaged-<time> and writes the rows it kept into a fresh database,
saying in the log what it skipped.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
import threading
import time
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tokenwire.state")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    protocol TEXT NOT NULL,
    owner TEXT NOT NULL,
    tokens BLOB NOT NULL,
    tokens_crc INTEGER NOT NULL,
    parent TEXT,
    ttl_s REAL,
    last_used REAL NOT NULL,
    metadata TEXT NOT NULL
)
"""
COLUMNS = "id, model, protocol, owner, tokens, tokens_crc, parent, ttl_s, last_used, metadata"
# an upsert, not INSERT OR REPLACE: a row keeps its rowid for life, so a salvage can probe rowids
UPSERT = (
    f"INSERT INTO sessions ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS.split(", ")[1:])
)
PROBE_MISSES = 10_000  # a salvage that cannot read the highest rowid stops after this many misses


@dataclass
class SessionRow:
    id: str
    model: str  # the model file's identity (engine/persistence.py model_identity)
    protocol: str
    owner: str
    tokens: list[int]
    parent: str | None = None
    ttl_s: float | None = None
    last_used: float = field(default_factory=time.time)  # wall clock
    metadata: dict[str, Any] = field(default_factory=dict)


def pack_tokens(tokens: list[int]) -> bytes:
    packed = array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(blob)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def _as_params(row: SessionRow) -> tuple[Any, ...]:
    blob = pack_tokens(row.tokens)
    return (row.id, row.model, row.protocol, row.owner, blob, zlib.crc32(blob), row.parent, row.ttl_s,
            row.last_used, json.dumps(row.metadata))  # fmt: skip


def _from_db(values: tuple[Any, ...]) -> SessionRow | None:
    """A row as stored, or None where its tokens do not match their CRC (a damaged page)."""
    sid, model, protocol, owner, blob, crc, parent, ttl, last_used, metadata = values
    if not isinstance(blob, bytes) or len(blob) % 4 or zlib.crc32(blob) != crc:
        return None
    return SessionRow(sid, model, protocol, owner, unpack_tokens(blob), parent, ttl, last_used,
                      json.loads(metadata))  # fmt: skip


class SessionStore:
    """The open database. Calls are serialised by a lock of its own (the engine calls it under
    its lock; the shutdown flush and the bench from other threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = _connect(path)
        self.write_errors = 0  # commits that failed (disk full): the session stays in RAM

    def put(self, row: SessionRow) -> bool:
        """Insert or replace one session's row, committed. False (logged) where the disk refused."""
        return self._write(UPSERT, _as_params(row))

    def put_many(self, rows: list[SessionRow]) -> bool:
        if not rows:
            return True
        with self._lock:
            try:
                with self._db:
                    self._db.executemany(UPSERT, [_as_params(r) for r in rows])
                return True
            except sqlite3.Error as exc:
                return self._failed(exc)

    def touch(self, session_id: str, last_used: float) -> bool:
        return self._write("UPDATE sessions SET last_used = ? WHERE id = ?", (last_used, session_id))

    def delete(self, session_id: str) -> bool:
        return self._write("DELETE FROM sessions WHERE id = ?", (session_id,))

    def _write(self, sql: str, params: tuple[Any, ...]) -> bool:
        with self._lock:
            try:
                with self._db:  # one transaction, committed on leaving
                    self._db.execute(sql, params)
                return True
            except sqlite3.Error as exc:
                return self._failed(exc)

    def _failed(self, exc: sqlite3.Error) -> bool:
        self.write_errors += 1
        if self.write_errors == 1 or self.write_errors % 100 == 0:
            log.warning("session store %s: commit failed (%s); the session stays in memory", self.path, exc)
        return False

    def rows(self) -> list[SessionRow]:
        with self._lock:
            return [r for r in map(_from_db, self._db.execute(f"SELECT {COLUMNS} FROM sessions")) if r]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.close()
            except sqlite3.Error as exc:
                log.warning("session store %s: closing: %s", self.path, exc)


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.isolation_level = ""  # `with db:` opens and commits a transaction
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(SCHEMA)
    db.commit()
    return db


def open_store(path: Path) -> tuple[SessionStore, list[SessionRow]]:
    """The store at `path` and the rows it holds. A damaged file is moved aside and the rows
    still readable carried into a fresh one (logged: how many kept, why the rest were not)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        store = SessionStore(path)
        if store._db.execute("PRAGMA quick_check").fetchone()[0] == "ok":
            rows = store.rows()
            skipped = store.count() - len(rows)
            if skipped:
                log.warning("session store %s: %d session(s) with damaged token lists skipped", path, skipped)
                kept = {r.id for r in rows}
                for (sid,) in list(store._db.execute("SELECT id FROM sessions")):
                    if sid not in kept:
                        store.delete(sid)
            return store, rows
        store._db.close()
    except sqlite3.Error as exc:
        log.warning("session store %s is damaged (%s)", path, exc)
    rows, problem = _salvage(path)
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        damaged = Path(str(path) + suffix)
        if damaged.exists():
            damaged.replace(Path(str(aside) + suffix))
    store = SessionStore(path)
    store.put_many(rows)
    log.warning(
        "session store %s was damaged (%s): kept %d readable session(s), moved the file to %s",
        path, problem, len(rows), aside,
    )  # fmt: skip
    return store, rows


def _salvage(path: Path) -> tuple[list[SessionRow], str]:
    """The rows of a damaged database still readable, each looked up by its rowid on its own: a
    lost page (a truncated file, a bad sector) costs the rows on it, not the scan's rest."""
    rows: list[SessionRow] = []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        # a file shorter than its header's page count is refused whole ("malformed") unless the
        # schema is writable: then the pages still there are read (measured: a file cut to 50%
        # gives back 7 of 16 rows, 0 without)
        db.execute("PRAGMA writable_schema=ON")
    except sqlite3.Error as exc:
        return rows, str(exc)
    try:
        try:
            highest = db.execute("SELECT max(rowid) FROM sessions").fetchone()[0] or 0
        except sqlite3.DatabaseError:
            highest = None  # the rightmost pages are gone: probe until a long run of misses
        bad = misses = 0
        rowid = 0
        while (rowid < highest) if highest is not None else (misses < PROBE_MISSES):
            rowid += 1
            try:
                values = db.execute(f"SELECT {COLUMNS} FROM sessions WHERE rowid = ?", (rowid,)).fetchone()
            except sqlite3.DatabaseError:
                bad, misses = bad + 1, misses + 1
                continue
            row = None if values is None else _from_db(values)
            if row is None:
                bad += values is not None
                misses += 1
                continue
            misses = 0
            rows.append(row)
        return rows, f"{bad} row(s) unreadable"
    except sqlite3.DatabaseError as exc:
        return rows, str(exc)
    finally:
        db.close()
