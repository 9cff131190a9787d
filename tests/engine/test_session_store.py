"""The session store (SQLite) and the KV block files on their own: what they keep, and that
damage to either is detected and costs only what it held (engine/session_store.py, kv_disk.py)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from tokenwire.engine.kv_disk import HEADER, BlockFiles
from tokenwire.engine.session_store import SessionRow, open_store


def _row(i: int, n: int = 3000) -> SessionRow:
    tokens = [(i * 7 + j) % 49152 for j in range(n)]
    return SessionRow(f"s{i}", "model-a", "openai", "owner", tokens, parent=None if i == 0 else "s0",
                      ttl_s=60.0, last_used=1e9, metadata={"i": i})  # fmt: skip


def test_rows_come_back_as_committed(tmp_path: Path) -> None:
    store, rows = open_store(tmp_path / "sessions.db")
    assert rows == []
    for i in range(3):
        assert store.put(_row(i))
    store.delete("s1")
    store.close()
    store, rows = open_store(tmp_path / "sessions.db")
    assert sorted(rows, key=lambda r: r.id) == [_row(0), _row(2)]
    store.close()


def test_a_row_whose_tokens_fail_their_crc_is_skipped_alone(tmp_path: Path, caplog) -> None:
    store, _ = open_store(tmp_path / "sessions.db")
    for i in range(3):
        store.put(_row(i))
    store.close()
    db = sqlite3.connect(tmp_path / "sessions.db")
    db.execute("UPDATE sessions SET tokens = zeroblob(length(tokens)) WHERE id = 's1'")  # garbled page
    db.commit()
    db.close()
    with caplog.at_level(logging.WARNING, "tokenwire.state"):
        store, rows = open_store(tmp_path / "sessions.db")
    assert sorted(r.id for r in rows) == ["s0", "s2"]
    assert "damaged token lists" in caplog.text
    store.close()


def test_a_truncated_database_keeps_the_rows_still_readable_and_moves_the_file_aside(
    tmp_path: Path, caplog
) -> None:
    path = tmp_path / "sessions.db"
    store, _ = open_store(path)
    for i in range(16):
        store.put(_row(i))
    store.close()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 // 4096 * 4096)
    with caplog.at_level(logging.WARNING, "tokenwire.state"):
        store, rows = open_store(path)  # never raises
    assert 0 < len(rows) < 16
    for row in rows:
        assert row == _row(int(row.id[1:]))  # whole rows only
    assert list(tmp_path.glob("sessions.db.damaged-*"))
    assert "was damaged" in caplog.text
    assert store.put(_row(99))  # the fresh database works
    store.close()
    store, again = open_store(path)
    assert len(again) == len(rows) + 1
    store.close()


def test_garbage_in_place_of_the_database_is_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "sessions.db").write_bytes(b"not a database at all" * 100)
    store, rows = open_store(tmp_path / "sessions.db")
    assert rows == []
    assert store.put(_row(0))
    store.close()


def test_block_files_are_written_once_and_damage_is_detected(tmp_path: Path, caplog) -> None:
    files = BlockFiles(tmp_path / "kv", 1024)
    a, b = bytes(range(16)), bytes(range(1, 17))
    assert files.write(a, bytes(1024)) and files.write(b, b"\x07" * 1024)
    assert files.write(a, bytes(1024)) and files.writes == 2  # content addressed: once
    with pytest.raises(ValueError):
        files.write(bytes(16), b"short")
    assert files.read(b) == b"\x07" * 1024
    path = files.path(b)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "tokenwire.state"):
        assert files.read(b) is None  # checksum mismatch: removed, computed again
    assert files.corrupt == 1 and not path.exists() and not files.has(b)
    files.path(a).write_bytes(files.path(a).read_bytes()[:500])  # torn
    assert files.read(a) is None and files.corrupt == 2
    assert "is damaged" in caplog.text


def test_read_checked_reads_into_a_reused_buffer_and_catches_every_kind_of_damage(tmp_path: Path) -> None:
    """The read path of a turn whose KV is on disk (persistence.py `_read_into`): the same
    checks as `read`, into a buffer the reader keeps, and `settle` accounts for it."""
    files = BlockFiles(tmp_path / "kv", 4096)
    payload = bytes(range(256)) * 16
    digests = [bytes([i]) * 16 for i in range(5)]
    for digest in digests:
        files.write(digest, payload)
    buffer = bytearray(HEADER.size + 4096 + 1)
    assert files.read_checked(digests[0], buffer) is None
    assert buffer[HEADER.size : HEADER.size + 4096] == payload
    assert files.settle(digests[0], None) and files.reads == 1
    flipped = bytearray(files.path(digests[1]).read_bytes())
    flipped[HEADER.size + 4000] ^= 0x10
    files.path(digests[1]).write_bytes(bytes(flipped))
    assert files.read_checked(digests[1], buffer) == "checksum mismatch"
    files.path(digests[2]).write_bytes(files.path(digests[2]).read_bytes() + b"x")  # longer
    assert "payload bytes" in (files.read_checked(digests[2], buffer) or "")
    files.path(digests[3]).write_bytes(files.path(digests[3]).read_bytes()[:100])  # torn
    assert "payload bytes" in (files.read_checked(digests[3], buffer) or "")
    files.path(digests[0]).replace(files.path(digests[4]))  # another block's file under this name
    assert files.read_checked(digests[4], buffer) == "not this block's file"
    for digest in digests[1:]:
        assert not files.settle(digest, files.read_checked(digest, buffer) or "gone")
        assert not files.has(digest)
    assert files.corrupt == 4 and files.reads == 1
    with pytest.raises(ValueError):
        files.read_checked(digests[0], bytearray(10))


def test_a_restart_indexes_the_files_and_drops_unfinished_ones(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path / "kv", 64)
    digest = bytes(range(16))
    files.write(digest, b"\x01" * 64)
    leftover = files.path(digest).with_name("deadbeef.kv.tmp")
    leftover.write_bytes(b"half")
    again = BlockFiles(tmp_path / "kv", 64)
    assert again.has(digest) and again.read(digest) == b"\x01" * 64
    assert not leftover.exists()
    assert again.bytes_total == files.bytes_total


def test_a_background_store_is_indexed_when_told_and_its_unfinished_files_dropped(tmp_path: Path) -> None:
    """The write-behind thread's path (engine/kv_write_behind.py): `store` writes the file with
    a temporary name of its own, `index` (under the engine lock) makes it known and counted."""
    files = BlockFiles(tmp_path / "kv", 64)
    digest = bytes(range(16))
    size = files.store(digest, b"\x02" * 64, ".tmp-wb")
    assert size == HEADER.size + 64 and files.path(digest).exists()
    assert not files.has(digest) and files.writes == 0 and files.bytes_total == 0
    files.index(digest, size)
    files.index(digest, size)  # twice (the scheduler's write raced it): counted once
    assert files.has(digest) and files.writes == 1 and files.bytes_total == size
    assert files.read(digest) == b"\x02" * 64
    leftover = files.path(digest).with_name("cafe.kv.tmp-wb")  # a crash mid-write
    leftover.write_bytes(b"half")
    again = BlockFiles(tmp_path / "kv", 64)
    assert again.has(digest) and not leftover.exists()
