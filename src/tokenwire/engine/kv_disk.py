"""KV blocks on disk: one file a block, named by the prefix hash the prefix cache already keys
it by (engine/kv_cache.py block_hash: the chained hash of every token up to the block's end),
so a prefix shared by many sessions is stored once.

Files live in `<state dir>/kv/<namespace>/<2 hex>/<32 hex>.kv`, the namespace a hash of the
model file's identity, the weight format, the KV dtype, the block size and ENGINE_ARITHMETIC:
another model or arithmetic reads another directory, so it can never be handed KV it did not
compute (its sessions' next turns are computed again from their tokens).

A file is its header (magic, payload length, XXH3-64 of the payload, the block's hash) and the
block's keys and values as the cache stores them (the scales too for q8). It is written under a
temporary name and renamed into place, so a reader sees a whole file or none; a torn or
corrupted one (a crash of the machine, a bad disk) fails its checksum or length check and is removed:
the one session holding it computes that block again. Files are written once (content
addressed: a block already on disk is never written again).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import xxhash

log = logging.getLogger("tokenwire.state")

# Bump when the arithmetic that produces keys and values changes (kernels, RoPE, rounding of
# stored values): files written by another version are in another namespace and never read.
# 2: the tiled types' int8 activations (tiles.h, issue 42) replaced int16 ones.
# 3: Q5_0 and Q5_1 joined them (tiles_types.h Tile32).
# 4: and Q5_K (tiles_types.h TileK45).
# 5: and IQ4_NL, IQ4_XS (tiles_types.h TileIq4).
# 6: AVX-512 attention over heads of 256 (Gemma 3) in the 16-lane grouped path (attention.h).
ENGINE_ARITHMETIC = 6
# The file format (part of the namespace: files of another format are never read). 2: XXH3-64
# for CRC32, which took ~15 ms of CPU to check a 2k-token session's 47 MB (3-4 GB/s here;
# XXH3 ~60 GB/s from cache, so the read itself is what is left).
MAGIC = b"TWKVBLK2"
HEADER = struct.Struct("<8sQQ16s")  # magic, payload bytes, XXH3-64 of the payload, block hash
SUFFIX = ".kv"


class BlockFiles:
    """The block files of one namespace, with an index of what is there (built by a scan at
    start: names and sizes only, nothing is read until a block is wanted)."""

    def __init__(self, root: Path, payload_bytes: int) -> None:
        self.root = root
        self.payload_bytes = payload_bytes
        root.mkdir(parents=True, exist_ok=True)
        self.sizes: dict[bytes, int] = {}  # block hash -> its file's bytes
        self.bytes_total = 0
        self.reads = self.read_bytes = self.writes = self.write_bytes = 0
        self.corrupt = 0  # files that failed their checks (removed)
        self.write_errors = 0  # writes the disk refused (full, read-only)
        self._scan()

    def _scan(self) -> None:
        stale = 0
        for sub in self.root.iterdir() if self.root.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                if not name.endswith(SUFFIX):  # a temporary file (*.tmp, *.tmp-wb) a crash left
                    stale += _remove(Path(entry.path))
                    continue
                try:
                    digest = bytes.fromhex(name[: -len(SUFFIX)])
                    size = entry.stat().st_size
                except (ValueError, OSError):
                    stale += _remove(Path(entry.path))
                    continue
                self.sizes[digest] = size
                self.bytes_total += size
        if stale:
            log.info("KV block files %s: removed %d unfinished file(s) a crash left", self.root, stale)

    def path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def has(self, digest: bytes) -> bool:
        return digest in self.sizes

    def write(self, digest: bytes, payload: bytes | memoryview) -> bool:
        """Store one block (no-op where it is already stored). False where the disk refused."""
        if digest in self.sizes:
            return True
        size = self.store(digest, payload, ".tmp")
        if size is not None:
            self.index(digest, size)
        return size is not None

    def store(self, digest: bytes, payload: bytes | memoryview, tmp_suffix: str) -> int | None:
        """The file alone, not indexed (`index` does that): thread-safe for a `tmp_suffix` of the
        caller's own (the write-behind thread's, engine/kv_write_behind.py). Its bytes, or None
        where the disk refused (counted and logged)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"KV block of {len(payload)} bytes, expected {self.payload_bytes}")
        path = self.path(digest)
        tmp = path.with_name(path.name + tmp_suffix)
        header = HEADER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload), digest)
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            _remove(tmp)
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.warning("KV block file %s not written: %s", path, exc.strerror or exc)
            return None
        return HEADER.size + len(payload)

    def index(self, digest: bytes, size: int) -> None:
        """A file `store` wrote is now known (and counted)."""
        if digest in self.sizes:
            return
        self.sizes[digest] = size
        self.bytes_total += size
        self.writes += 1
        self.write_bytes += size

    def fetch(self, digest: bytes) -> tuple[bytearray | None, str | None]:
        """A block file's bytes and what is wrong with them (None: nothing). Thread-safe and
        counts nothing: the checksum and the read release the GIL, so reads run side by side
        (`prefetch`); `read`/`accept` account for what was fetched."""
        path = self.path(digest)
        try:
            with open(path, "rb") as f:
                data = bytearray(HEADER.size + self.payload_bytes + 1)  # one more: a longer file shows
                n = f.readinto(data)
        except OSError as exc:
            return None, f"unreadable: {exc.strerror or exc}"
        del data[n:]
        return data, _check(data, digest, self.payload_bytes)

    def read_checked(self, digest: bytes, buffer: bytearray) -> str | None:
        """Read a block file into `buffer` (a reader's own, reused: no new 47 MB a turn to
        allocate and zero) and check it; what is wrong with it (None: the payload is at
        buffer[HEADER.size:][:payload_bytes]). Thread-safe and counts nothing (`settle` does):
        the read and the checksum release the GIL."""
        if len(buffer) < HEADER.size + self.payload_bytes + 1:
            raise ValueError("buffer smaller than a block file and one byte")
        try:
            fd = os.open(self.path(digest), os.O_RDONLY)
            try:
                n = os.preadv(fd, [buffer], 0)  # one byte more than a file: a longer file shows
            finally:
                os.close(fd)
        except OSError as exc:
            return f"unreadable: {exc.strerror or exc}"
        return _check(memoryview(buffer)[:n], digest, self.payload_bytes)

    def settle(self, digest: bytes, problem: str | None) -> bool:
        """Account for a `read_checked`: True where it is good; else logged, counted, removed."""
        if problem is not None:
            if not problem.startswith("unreadable"):
                self.corrupt += 1
            log.warning("KV block file %s is damaged (%s): computed again", self.path(digest), problem)
            self.remove(digest)
            return False
        self.reads += 1
        self.read_bytes += HEADER.size + self.payload_bytes
        return True

    def accept(self, digest: bytes, fetched: tuple[bytearray | None, str | None]) -> memoryview | None:
        """A fetched block's payload, or None (logged, counted, the file removed) where it failed."""
        data, problem = fetched
        if data is None or problem is not None:
            if data is not None:
                self.corrupt += 1
            log.warning("KV block file %s is damaged (%s): computed again", self.path(digest), problem)
            self.remove(digest)
            return None
        self.reads += 1
        self.read_bytes += len(data)
        return memoryview(data)[HEADER.size :]

    def read(self, digest: bytes) -> memoryview | None:
        """A block's payload, or None where it is absent or fails its checks (then removed)."""
        if digest not in self.sizes:
            return None
        return self.accept(digest, self.fetch(digest))

    def remove(self, digest: bytes) -> None:
        size = self.sizes.pop(digest, None)
        if size is not None:
            self.bytes_total -= size
        _remove(self.path(digest))


def _check(data: bytes | bytearray | memoryview, digest: bytes, payload_bytes: int) -> str | None:
    if len(data) < HEADER.size:
        return "shorter than its header"
    magic, length, checksum, stored = HEADER.unpack_from(data)
    if magic != MAGIC or stored != digest:
        return "not this block's file"
    if length != payload_bytes or len(data) != HEADER.size + length:
        return f"{len(data) - HEADER.size} payload bytes, expected {payload_bytes}"
    if xxhash.xxh3_64_intdigest(memoryview(data)[HEADER.size :]) != checksum:  # releases the GIL
        return "checksum mismatch"
    return None


def _remove(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:
        return 0
