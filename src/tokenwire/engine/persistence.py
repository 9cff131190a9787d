"""Sessions that outlive the process (`serve --state-dir`, on by default; `--no-persist`).

The engine calls this module at a few points (engine.py, session_calls.py, scheduler.py):
- a persisted session's row is committed to the session store (engine/session_store.py) when it
  is claimed by a protocol, at the end of every turn, and on every fork and truncate; closing or
  expiring it deletes the row;
- when the scheduler takes an idle session's KV blocks back for another request, its full
  blocks are first written to block files (engine/kv_disk.py), once each;
- a prefix-cache miss asks the block files before computing: a hit is read into a free block
  and registered in the prefix cache, as if it had never left;
- at start, the rows of this model file become sessions again, with their ids, tokens,
  owners and TTLs (the idle time before the restart counts); their KV is not in RAM, so their
  next turn reads it from the block files (or computes what is missing);
- at shutdown (SIGTERM), the sessions' KV still in RAM is written within what is left of
  --shutdown-grace, most recently used first.

Only sessions a protocol claims persist (Salience and OpenAI /v1/sessions sessions, and their
forks): scratch sessions a protocol opens for itself (one request's, a connection's) are closed
with what opened them, and persisting them would keep orphans after a crash.

Sessions of another model file in the same state directory are left untouched and not served
(logged at start): their tokens mean nothing to another vocabulary. The same model with another
--kv-dtype, weight format or ENGINE_ARITHMETIC restores its sessions and computes their KV
again from their tokens (the block files are namespaced by all of these).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenwire.engine.kv_cache import ROOT_HASH, KVCache, OutOfBlocksError, block_hash
from tokenwire.engine.kv_disk import HEADER, BlockFiles
from tokenwire.engine.kv_disk_layout import (
    block_payload_bytes,
    block_tensors,
    kv_namespace,
    model_identity,
    read_block,
    write_block,
)
from tokenwire.engine.session import Session
from tokenwire.engine.session_store import SessionRow, open_store

if TYPE_CHECKING:
    from tokenwire.model.loader import ModelSource

log = logging.getLogger("tokenwire.state")


class SessionPersistence:
    def __init__(self, state_dir: Path, max_gb: float | None = None, model_id: str | None = None) -> None:
        """`max_gb`: the block files' budget (--state-max-gb; None: unbounded). `model_id`: the
        model's identity where it has no files (a model built in memory: tests)."""
        self.state_dir = Path(state_dir)
        self.max_bytes = None if max_gb is None else int(max_gb * 2**30)
        self.model_id = model_id
        self.files: BlockFiles | None = None
        self.evicted_sessions = 0  # sessions whose block files went for --state-max-gb
        self.restored = self.skipped = self.expired = 0
        self._chains: dict[str, tuple[int, list[bytes]]] = {}  # session -> (tokens hashed, hashes)
        # frees RAM blocks for a read (the engine's: an idle session's KV to disk and out of RAM)
        self.make_room: Callable[[], bool] = lambda: False
        self._readers: ThreadPoolExecutor | None = None
        # blocks read ahead (prefetch): digest -> (the block read into, or -1 for a buffer; the read)
        self._ahead: dict[bytes, tuple[int, Future[Any]]] = {}
        self._host: list[tuple[Any, int]] | None = None  # the cache's tensors as bytes (_host_views)
        self._local = threading.local()  # each reader's reused buffer
        self.writing: set[bytes] = set()  # blocks the write-behind thread is writing (kv_write_behind.py)
        # what may leave block files no session holds (a persisted session closed, a partial
        # block written over an older one): the write-behind's cue to collect them
        self.orphaning = 0

    # ------------------------------------------------------------------ start
    def open(
        self, source: ModelSource | None, weights: str | None, kv: KVCache, device: str
    ) -> list[SessionRow]:
        """Open the store and the block files of this model and arithmetic; the rows to restore."""
        self.kv = kv
        if self.model_id is None:
            if source is None:
                raise ValueError("a model built in memory persists its sessions only with a model_id")
            self.model_id = model_identity(source, self.state_dir)
        self.store, rows = open_store(self.state_dir / "sessions.db")
        if kv.window_pool is None:  # sliding-window pools keep only part of a sequence: RAM only
            namespace = kv_namespace(self.model_id, weights, kv, device)
            self.files = BlockFiles(self.state_dir / "kv" / namespace, block_payload_bytes(kv))
            kv.lower_tier = self
        mine = [r for r in rows if r.model == self.model_id]
        self.skipped = len(rows) - len(mine)
        if self.skipped:
            log.warning(
                "state dir %s: %d session(s) of another model file left as they are (not served here)",
                self.state_dir, self.skipped,
            )  # fmt: skip
        return mine

    def restore(self, rows: Iterable[SessionRow], vocab_size: int) -> list[Session]:
        """Sessions again from their rows; those past their TTL (idle time before the restart
        counted) are deleted instead."""
        sessions = []
        now_wall, now = time.time(), time.monotonic()
        for row in rows:
            idle = max(0.0, now_wall - row.last_used)
            if row.ttl_s is not None and idle > row.ttl_s:
                self.store.delete(row.id)
                self.expired += 1
                continue
            if any(not 0 <= t < vocab_size for t in row.tokens):
                log.warning("session %s: a token out of this vocabulary; not restored", row.id)
                self.skipped += 1
                continue
            session = Session(row.id, tokens=row.tokens, ttl_s=row.ttl_s, protocol=row.protocol,
                              owner=row.owner, parent=row.parent, metadata=row.metadata)  # fmt: skip
            session.last_used = now - idle
            sessions.append(session)
        self.restored = len(sessions)
        blocks = len(self.files.sizes) if self.files is not None else 0
        log.info(
            "state dir %s: %d session(s) restored, %d expired, %d skipped; %d KV block file(s) (%.1f MiB)",
            self.state_dir, self.restored, self.expired, self.skipped, blocks,
            (self.files.bytes_total if self.files is not None else 0) / 2**20,
        )  # fmt: skip
        return sessions

    # ------------------------------------------------------------------ the session store
    def commit(self, session: Session) -> None:
        """Must hold the engine lock. The session's row as it is now (a persisted session's)."""
        if session.protocol and not session.images:  # image blocks are not stored: RAM only
            self.store.put(self._row(session))

    def forget(self, session: Session) -> None:
        if session.protocol:
            self.store.delete(session.id)
            self.orphaning += 1
        self._chains.pop(session.id, None)

    def _row(self, session: Session) -> SessionRow:
        last_used = time.time() - (time.monotonic() - session.last_used)
        assert self.model_id is not None
        return SessionRow(session.id, self.model_id, session.protocol, session.owner, list(session.tokens),
                          session.parent, session.ttl_s, last_used, session.metadata)  # fmt: skip

    # ------------------------------------------------------------------ KV blocks on disk
    def spill(self, session: Session) -> int:
        """Must hold the engine lock, no step running on the session's blocks. Write the full
        blocks of a persisted session not yet on disk; how many were written."""
        files = self.files
        if files is None or not session.protocol or session.images:
            return 0
        written = 0
        for digest, block in self.unwritten(*self.stored_blocks(session)):
            if not files.write(digest, read_block(self.kv, block)):
                break  # the disk refused (full): the rest stays RAM-only, computed again if evicted
            written += 1
        return written

    def unwritten(self, blocks: list[tuple[bytes, int]], tail: bytes | None) -> list[tuple[bytes, int]]:
        """Must hold the engine lock. Of a session's `stored_blocks`, those no file holds and no
        write is under way for (the write-behind holds a reference on those). A partial block
        among them supersedes the session's older one, whose file then goes (`orphaning`)."""
        files = self.files
        todo = [(d, b) for d, b in blocks if files is not None and not files.has(d) and d not in self.writing]
        self.orphaning += tail is not None and bool(todo) and todo[-1][0] == tail
        return todo

    def stored_blocks(self, session: Session) -> tuple[list[tuple[bytes, int]], bytes | None]:
        """(hash, block) of what a session's files hold: its full blocks, then the partial one
        at its computed end where it has positions there (stored under the hash of the tokens up
        to that end, a turn after a restart computes only its own positions: Session._match_tail);
        and that partial block's hash."""
        blocks = list(zip(session.full_hashes, session.block_table, strict=False))
        bs = self.kv.block_size
        full, n = divmod(session.num_computed, bs)
        if not n or session.images or len(session.block_table) <= full or len(session.full_hashes) < full:
            return blocks, None
        previous = session.full_hashes[full - 1] if full else ROOT_HASH
        tail = block_hash(previous, session.tokens[full * bs : session.num_computed])
        return [*blocks, (tail, session.block_table[full])], tail

    def held(self, session: Session) -> list[bytes]:
        """The block files a session's next turn may read: its full blocks' and its tail's (at
        the end of its tokens, or one before: a generated last token is not computed yet)."""
        bs, tokens = self.kv.block_size, session.tokens
        chain = self.chain(session)
        tails = []
        for end in {len(tokens) - 1, len(tokens)}:
            full, n = divmod(end, bs)
            if end > 0 and n:
                tails.append(block_hash(chain[full - 1] if full else ROOT_HASH, tokens[full * bs : end]))
        return chain + tails

    def prefetch(self, digests: list[bytes]) -> None:
        """The prefix cache's lower tier (KVCache.lower_tier), told the blocks a sequence will ask
        for next: the ones on disk and not in RAM get a free block each now (an idle session's
        RAM freed for them where the cache is full), and two threads read, check and copy each
        file into its block (`_read_into`: the read, the checksum and numpy's copy release the GIL);
        `load` hands them over as they finish, `finish` frees what the match did not take.
        Measured on a 2k-token SmolLM2 session (128 files, 47 MB), 2 shared cores: reading each
        file into a new buffer, then copying it into the cache with torch on the engine thread,
        took 0.26 s a turn on average (torch's intra-op threads, a loaded machine, py-spy); see
        docs/sessions.md for the turn it gives now."""
        self.finish()
        files = self.files
        if files is None:
            return
        allocator = self.kv.allocator
        wanted = []
        for digest in digests[: self.kv.num_blocks]:
            if allocator.holds(digest):
                continue  # still in RAM: match_prefix's lookup finds it
            if not files.has(digest):
                break
            wanted.append(digest)
        if len(wanted) < 2:
            return  # one block: `load` reads it on the spot
        while allocator.num_available < len(wanted) and self.make_room():
            pass
        if self._readers is None:
            self._readers = ThreadPoolExecutor(2, thread_name_prefix="tokenwire-kv-read")
        host = self._host_views()
        for digest in wanted[: allocator.num_available]:
            if host is None:  # not host memory: read into a buffer, copied by `load`
                self._ahead[digest] = (-1, self._readers.submit(files.fetch, digest))
                continue
            block = allocator.allocate()
            self._ahead[digest] = (block, self._readers.submit(self._read_into, digest, block, host))

    def finish(self) -> None:
        """The match is over: blocks read ahead that it did not take go back to the free list
        (after their reads end: a thread may still be writing into them)."""
        for block, future in self._ahead.values():
            future.result()
            if block >= 0:
                self.kv.allocator.decref(block)
        self._ahead.clear()

    def load(self, digest: bytes) -> int | None:
        """A block read from its file into a free block, registered under `digest` with no
        reference (the caller takes one); None where it is not on disk, or fails its checks."""
        files = self.files
        if files is None or not files.has(digest):
            return None
        allocator = self.kv.allocator
        ahead = self._ahead.pop(digest, None)
        if ahead is not None and ahead[0] >= 0:  # read straight into its block
            block, future = ahead
            if not files.settle(digest, future.result()):
                allocator.decref(block)
                return None
            allocator.register(block, digest)
            allocator.decref(block)  # cached and unreferenced: match_prefix's lookup takes it
            return block
        block = self._into_free_block(
            lambda: files.read(digest) if ahead is None else files.accept(digest, ahead[1].result())
        )
        if block is not None:
            allocator.register(block, digest)
            allocator.decref(block)
        return block

    def load_tail(self, digest: bytes) -> int | None:
        """A session's partial block (`stored_blocks`) read from its file into a free block of the
        caller's own, not registered in the prefix cache (its content is not a full block's)."""
        files = self.files
        if files is None or not files.has(digest):
            return None
        return self._into_free_block(lambda: files.read(digest))

    def _into_free_block(self, payload_of: Callable[[], memoryview | None]) -> int | None:
        """A free block (an idle session's RAM freed where none is) holding `payload_of()`, one
        reference taken; None where there is no room or the file failed its checks."""
        allocator = self.kv.allocator
        if allocator.num_available == 0 and not self.make_room():
            return None
        payload = payload_of()
        if payload is None:
            return None
        try:
            block = allocator.allocate()
        except OutOfBlocksError:
            return None
        write_block(self.kv, block, payload)
        return block

    def reading(self, digest: bytes) -> bool:
        """Whether a reader thread may be reading the block's file now (`prefetch`)."""
        return digest in self._ahead

    def _host_views(self) -> list[tuple[Any, int]] | None:
        """The cache's tensors as [layers, blocks, bytes of a block's layer] uint8 arrays with
        their bytes per block; None where the cache is not in host memory."""
        if self._host is None:
            tensors = block_tensors(self.kv)
            if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
                return None
            self._host = []
            for t in tensors:
                raw = t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], -1)
                self._host.append((raw, t[:, 0].numel() * t.element_size()))
        return self._host

    def _read_into(self, digest: bytes, block: int, host: list[tuple[Any, int]]) -> str | None:
        """A reader thread's job: the file into the thread's buffer, checked, copied into the
        cache's `block` (numpy's copy releases the GIL: the two readers and the engine thread
        run side by side). What is wrong with the file, or None."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = bytearray(HEADER.size + self.files.payload_bytes + 1)  # type: ignore[union-attr]
        problem = self.files.read_checked(digest, buffer)  # type: ignore[union-attr]
        if problem is None:
            offset = HEADER.size
            for array, size in host:
                array[:, block] = np.frombuffer(buffer, np.uint8, size, offset).reshape(array.shape[0], -1)
                offset += size
        return problem

    def enforce_budget(self, sessions: list[Session], busy: set[str]) -> None:
        """Over --state-max-gb: remove block files no session holds, then the files of whole
        idle sessions, least recently used first (their rows stay: a later turn computes again)."""
        files = self.files
        if files is None or self.max_bytes is None or files.bytes_total <= self.max_bytes:
            return
        persisted = sorted((s for s in sessions if s.protocol), key=lambda s: s.last_used)
        users: dict[bytes, int] = {}
        chains = {s.id: self.held(s) for s in persisted}
        for chain in chains.values():
            for digest in chain:
                users[digest] = users.get(digest, 0) + 1
        for digest in [d for d in files.sizes if d not in users]:
            files.remove(digest)
        target = int(self.max_bytes * 0.9)  # some room, so the next spills do not evict again at once
        for session in persisted:
            if files.bytes_total <= target:
                break
            if session.id in busy:
                continue
            gone = 0
            for digest in chains[session.id]:
                users[digest] -= 1
                if users[digest] == 0 and files.has(digest):
                    files.remove(digest)
                    gone += 1
            if gone:
                self.evicted_sessions += 1
                log.info("session %s: KV block files evicted (--state-max-gb); its tokens stay", session.id)

    def chain(self, session: Session) -> list[bytes]:
        """The prefix hashes of a session's full blocks (as Session.computed makes them)."""
        bs = self.kv.block_size
        full = len(session.tokens) // bs
        if len(session.full_hashes) >= full:
            return session.full_hashes[:full]
        done, hashes = self._chains.get(session.id, (0, []))
        if done > len(session.tokens) or hashes[: len(session.full_hashes)] != session.full_hashes:
            done, hashes = 0, []
        hashes = hashes[: done // bs]
        while len(hashes) < full:
            start = len(hashes) * bs
            hashes.append(block_hash(hashes[-1] if hashes else ROOT_HASH, session.tokens[start : start + bs]))
        self._chains[session.id] = (full * bs, hashes)
        return hashes

    # ------------------------------------------------------------------ shutdown
    def flush(self, sessions: list[Session], deadline: float, blocks_safe: bool) -> None:
        """Write the KV still in RAM (most recent sessions first, until `deadline`) when no step
        can touch it (`blocks_safe`), commit every persisted session's row, close the store."""
        written = pending = 0
        for session in sorted(sessions, key=lambda s: s.last_used, reverse=True):
            if not blocks_safe or time.monotonic() >= deadline:
                pending += sum(1 for d in session.full_hashes if self.files and not self.files.has(d))
                continue
            written += self.spill(session)
        self.store.put_many([self._row(s) for s in sessions if s.protocol and not s.images])
        self.store.close()
        if self._readers is not None:
            self._readers.shutdown(wait=False)
        if pending:
            log.warning("shutdown: %d KV block(s) not written within --shutdown-grace", pending)
        log.info("state saved: %d session(s), %d KV block(s) written at shutdown", len(sessions), written)

    def stats(self, sessions: Iterable[Session]) -> dict[str, Any]:
        files = self.files
        return {
            "sessions_persisted": sum(1 for s in sessions if s.protocol),
            "kv_disk_blocks": len(files.sizes) if files else 0,
            "kv_disk_bytes": files.bytes_total if files else 0,
            "kv_disk_reads": files.reads if files else 0,
            "kv_disk_read_bytes": files.read_bytes if files else 0,
            "kv_disk_writes": files.writes if files else 0,
            "kv_disk_write_bytes": files.write_bytes if files else 0,
            "kv_disk_corrupt": files.corrupt if files else 0,
            "kv_disk_evicted_sessions": self.evicted_sessions,
            "state_write_errors": self.store.write_errors + (files.write_errors if files else 0),
        }
