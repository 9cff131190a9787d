"""Sessions: a persistent token list plus the KV blocks that hold its computed prefix.

Invariant: positions [0, num_computed) have their keys/values in the blocks of
`block_table` (block i covers positions [i*B, (i+1)*B)). Tokens past num_computed are
pending: the scheduler feeds them to the model. All methods run under the engine lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tokenwire.engine.kv_cache import ROOT_HASH, KVCache, block_hash
from tokenwire.engine.vision import block_key


class Ttl(Enum):
    """A session lifetime that is not a number of seconds (None means "never expires")."""

    DEFAULT = "default"  # the engine's session_ttl_s (--session-ttl)


@dataclass(eq=False)
class Session:
    id: str
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # hashes of the leading full blocks whose content is final (chained prefix hashes)
    full_hashes: list[bytes] = field(default_factory=list)
    ttl_s: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    ephemeral: bool = False  # created for one request and closed with it
    # vision models: the attached images (engine/vision.py SessionImage), sorted by position
    images: list[Any] = field(default_factory=list)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # ------------------------------------------------------------------ KV bookkeeping
    def release(self, kv: KVCache) -> None:
        for block in self.block_table:
            kv.allocator.decref(block)
        self.block_table = []
        self.full_hashes = []
        self.num_computed = 0

    def truncate(self, length: int, kv: KVCache) -> None:
        """Keep tokens [0, length). Blocks past the new end are released."""
        del self.tokens[length:]
        self.images = [b for b in self.images if b.end <= length]  # the engine refuses splits
        self.num_computed = min(self.num_computed, length)
        self._drop_blocks_after(length, kv)

    def uncompute_from(self, position: int, kv: KVCache) -> None:
        """Forget the KV of positions >= position so they are computed again (for logits)."""
        if position < self.num_computed:
            self.num_computed = position
            self._drop_blocks_after(position, kv)

    def _drop_blocks_after(self, length: int, kv: KVCache) -> None:
        keep = -(-length // kv.block_size)
        for block in self.block_table[keep:]:
            kv.allocator.decref(block)
        del self.block_table[keep:]
        del self.full_hashes[length // kv.block_size :]

    def fork(self, new_id: str, at: int, kv: KVCache) -> Session:
        """A session holding tokens [0, at), sharing this one's blocks (no copy, no compute)."""
        child = Session(new_id, tokens=self.tokens[:at], ttl_s=self.ttl_s)
        child.images = [b for b in self.images if b.end <= at]  # the engine refuses splits
        child.num_computed = min(self.num_computed, at)
        keep = -(-child.num_computed // kv.block_size)
        child.block_table = self.block_table[:keep]
        for block in child.block_table:
            kv.allocator.incref(block)
        child.full_hashes = self.full_hashes[: child.num_computed // kv.block_size]
        return child

    def match_prefix(self, limit: int, kv: KVCache) -> int:
        """Reuse cached blocks for pending tokens; returns how many positions were reused.

        Only positions below `limit` may be taken from the cache (the caller needs logits or
        hidden states from the others, or must compute at least the last token).
        """
        bs = kv.block_size
        if self.num_computed % bs or len(self.block_table) * bs != self.num_computed:
            return 0
        reused = 0
        while self.num_computed + bs <= limit:
            start = self.num_computed
            digest = self._block_hash(start, bs)
            block = kv.allocator.lookup(digest)
            if block is None:
                break
            kv.allocator.incref(block)
            self.block_table.append(block)
            self.full_hashes.append(digest)
            self.num_computed += bs
            reused += bs
        return reused

    def _prefix_hash(self) -> bytes:
        return self.full_hashes[-1] if self.full_hashes else ROOT_HASH

    def _block_hash(self, start: int, bs: int) -> bytes:
        """The prefix-cache key of the block at `start`: the chained hash of the tokens and of
        the images whose pads it holds (two images with the same pad run never share KV). The
        image key is whole 20-byte entries and the token part fixed-size, so it is unambiguous."""
        previous = self._prefix_hash()
        if self.images:
            previous += block_key(self.images, start, start + bs)
        return block_hash(previous, self.tokens[start : start + bs])

    def reserve(self, end: int, kv: KVCache) -> None:
        """Make positions [num_computed, end) writable: allocate blocks, copy shared ones.

        Raises OutOfBlocksError (leaving the session consistent) when memory is short.
        """
        bs = kv.block_size
        first = self.num_computed // bs
        for index in range(first, min(len(self.block_table), -(-end // bs))):
            block = self.block_table[index]
            if kv.allocator.refcount[block] > 1:
                fresh = kv.allocator.allocate()
                kv.copy_block(block, fresh)
                kv.allocator.decref(block)
                self.block_table[index] = fresh
            else:
                kv.allocator.unregister(block)
        while len(self.block_table) * bs < end:
            self.block_table.append(kv.allocator.allocate())

    def blocks_needed(self, end: int, kv: KVCache) -> int:
        """Upper bound on the fresh blocks reserve(end) takes."""
        bs = kv.block_size
        new = max(0, -(-end // bs) - len(self.block_table))
        first = self.num_computed // bs
        shared = sum(
            1
            for i in range(first, min(len(self.block_table), -(-end // bs)))
            if kv.allocator.refcount[self.block_table[i]] > 1
        )
        return new + shared

    def computed(self, end: int, kv: KVCache) -> None:
        """Positions up to `end` now hold KV; register newly completed full blocks."""
        self.num_computed = end
        bs = kv.block_size
        while (len(self.full_hashes) + 1) * bs <= end:
            i = len(self.full_hashes)
            digest = self._block_hash(i * bs, bs)
            self.full_hashes.append(digest)
            kv.allocator.register(self.block_table[i], digest)
