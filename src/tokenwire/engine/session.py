"""Sessions: a persistent token list plus the KV blocks that hold its computed prefix.

Invariant: positions [0, num_computed) have their keys/values in the blocks of
`block_table` (block i covers positions [i*B, (i+1)*B)). Tokens past num_computed are
pending: the scheduler feeds them to the model. All methods run under the engine lock.

Where the cache keeps windowed layers apart (KVCache.window_pool), `window_table` holds their
blocks by the same positions, but only those a query at num_computed or later can still
reach: older ones are let go (-1) as the sequence moves on. They stay in the prefix cache
until evicted, so going back (truncate, fork, a constraint's backtrack) takes
them from there; a block evicted meanwhile means the whole sequence is computed again, as its
keys depend on the ones before it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tokenwire.engine.kv_cache import ROOT_HASH, BlockAllocator, KVCache, KVPool, LowerTier, block_hash
from tokenwire.engine.vision import block_key


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share (what a session keeps of a new one)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Ttl(Enum):
    """A session lifetime that is not a number of seconds (None means "never expires")."""

    DEFAULT = "default"  # the engine's session_ttl_s (--session-ttl)


@dataclass(eq=False)
class Session:
    id: str
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)  # -1: a block the window has left
    # hashes of the leading full blocks whose content is final (chained prefix hashes)
    full_hashes: list[bytes] = field(default_factory=list)
    ttl_s: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    ephemeral: bool = False  # created for one request and closed with it
    # vision models: the attached images (engine/vision.py SessionImage), sorted by position
    images: list[Any] = field(default_factory=list)
    # persisted sessions (engine/persistence.py): the protocol that claimed it ("" = RAM only),
    # the digest of the key that owns it, the session it was forked from, the protocol's notes
    protocol: str = ""
    owner: str = ""
    parent: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    from_disk: int = 0  # positions the last match_prefix read from the block files

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # ------------------------------------------------------------------ KV bookkeeping
    def release(self, kv: KVCache) -> None:
        for block in self.block_table:
            kv.allocator.decref(block)
        self._let_go(self.window_table, kv)
        self.block_table = []
        self.window_table = []
        self.full_hashes = []
        self.num_computed = 0

    @staticmethod
    def _let_go(blocks: list[int], kv: KVCache) -> None:
        if kv.window_pool is not None:
            for block in blocks:
                if block >= 0:
                    kv.window_pool.allocator.decref(block)

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
        """Blocks past `length` released; then the window blocks the new end reaches taken back."""
        keep = -(-length // kv.block_size)
        for block in self.block_table[keep:]:
            kv.allocator.decref(block)
        del self.block_table[keep:]
        self._let_go(self.window_table[keep:], kv)
        del self.window_table[keep:]
        hashes, self.full_hashes = self.full_hashes, self.full_hashes[: length // kv.block_size]
        self._restore_window(kv, hashes)

    def _restore_window(self, kv: KVCache, hashes: list[bytes]) -> None:
        """Take back from the prefix cache the window blocks a query at num_computed reaches
        and the sequence let go; where one is gone, compute the sequence again from the start.
        `hashes`: the full blocks' hashes before the cut (a block the cut left partial was full
        when let go; its kept positions hold the same keys, the others are written again)."""
        pool = kv.window_pool
        if pool is None:
            return
        for i in range(kv.first_needed_block(self.num_computed), -(-self.num_computed // kv.block_size)):
            if self.window_table[i] >= 0:
                continue
            block = pool.allocator.lookup(hashes[i]) if i < len(hashes) else None
            if block is None:
                self.uncompute_from(0, kv)
                return
            pool.allocator.incref(block)
            self.window_table[i] = block

    def _slide_window(self, kv: KVCache) -> None:
        """Let go of the window blocks no query at num_computed or later reaches (those let go
        before them are already -1: walk back from the newest such block to the first -1)."""
        pool = kv.window_pool
        if pool is None:
            return
        for i in range(kv.first_needed_block(self.num_computed) - 1, -1, -1):
            block = self.window_table[i]
            if block < 0:
                break
            pool.allocator.decref(block)
            self.window_table[i] = -1

    def fork(self, new_id: str, at: int, kv: KVCache) -> Session:
        """A session holding tokens [0, at), sharing this one's blocks (no copy, no compute)."""
        child = Session(new_id, tokens=self.tokens[:at], ttl_s=self.ttl_s, protocol=self.protocol,
                        owner=self.owner, parent=self.id, metadata=dict(self.metadata))  # fmt: skip
        child.images = [b for b in self.images if b.end <= at]  # the engine refuses splits
        child.num_computed = min(self.num_computed, at)
        keep = -(-child.num_computed // kv.block_size)
        child.block_table = self.block_table[:keep]
        for block in child.block_table:
            kv.allocator.incref(block)
        child.window_table = self.window_table[:keep]
        if kv.window_pool is not None:
            for block in child.window_table:
                if block >= 0:
                    kv.window_pool.allocator.incref(block)
        child.full_hashes = self.full_hashes[: child.num_computed // kv.block_size]
        child._restore_window(kv, self.full_hashes)
        return child

    def match_prefix(self, limit: int, kv: KVCache) -> int:
        """Reuse cached blocks for pending tokens; returns how many positions were reused.

        Only positions below `limit` may be taken from the cache (the caller needs logits or
        hidden states from the others, or must compute at least the last token).
        """
        bs = kv.block_size
        if self.num_computed % bs or len(self.block_table) * bs != self.num_computed:
            return 0
        pool = kv.window_pool
        reused = self.from_disk = 0
        tier, prefetched = kv.lower_tier, False
        try:
            while self.num_computed + bs <= limit:
                start = self.num_computed
                digest = self._block_hash(start, bs)
                block = kv.allocator.lookup(digest)
                if block is None and tier is not None:  # the block files (engine/persistence.py)
                    if not prefetched:
                        tier.prefetch(self._hashes_ahead(digest, start, limit, bs))
                        prefetched = True
                    block = tier.load(digest)
                    self.from_disk += bs if block is not None else 0
                if block is None:
                    break
                if pool is not None:  # the windowed layers' block too, or the match ends here
                    window_block = pool.allocator.lookup(digest)
                    if window_block is None:
                        break
                    pool.allocator.incref(window_block)
                    self.window_table.append(window_block)
                kv.allocator.incref(block)
                self.block_table.append(block)
                self.full_hashes.append(digest)
                self.num_computed += bs
                reused += bs
            if tier is not None and pool is None and not self.images:
                reused += self._match_tail(limit, kv, tier)
        finally:  # blocks read ahead and not taken go back (an exception included)
            if prefetched and tier is not None:
                tier.finish()
        self._slide_window(kv)
        return reused

    def _match_tail(self, limit: int, kv: KVCache, tier: LowerTier) -> int:
        """The partial block after the full ones, where the lower tier keeps it (the positions a
        session had computed past its last full block when it left RAM, under the hash of the
        tokens there): a turn after a restart then computes only its new positions, as a turn
        from RAM does. Longest first, below `limit`; the block is the session's own (not cached)."""
        bs, start = kv.block_size, self.num_computed
        for n in range(min(bs - 1, limit - start), 0, -1):
            block = tier.load_tail(block_hash(self._prefix_hash(), self.tokens[start : start + n]))
            if block is not None:
                self.block_table.append(block)
                self.num_computed += n
                self.from_disk += n
                return n
        return 0

    def _hashes_ahead(self, digest: bytes, start: int, limit: int, bs: int) -> list[bytes]:
        """The prefix hashes of the full blocks from `start` (whose hash is `digest`) below `limit`."""
        hashes = [digest]
        if self.images:  # their keys take the images' places: one block at a time
            return hashes
        for at in range(start + bs, limit - bs + 1, bs):
            hashes.append(block_hash(hashes[-1], self.tokens[at : at + bs]))
        return hashes

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
        first = self.num_computed // kv.block_size
        self._writable(self.block_table, kv.pool, first, end, kv.block_size)
        if kv.window_pool is not None:
            self._writable(self.window_table, kv.window_pool, first, end, kv.block_size)

    @staticmethod
    def _writable(table: list[int], pool: KVPool, first: int, end: int, bs: int) -> None:
        """Blocks `first` .. covering `end` of `table` this session's own (copied where shared,
        out of the prefix cache where about to change), and new ones up to `end`."""
        for index in range(first, min(len(table), -(-end // bs))):
            block = table[index]
            if pool.allocator.refcount[block] > 1:
                fresh = pool.allocator.allocate()
                pool.copy_block(block, fresh)
                pool.allocator.decref(block)
                table[index] = fresh
            else:
                pool.allocator.unregister(block)
        while len(table) * bs < end:
            table.append(pool.allocator.allocate())

    def blocks_needed(self, end: int, kv: KVCache) -> tuple[int, int]:
        """Upper bounds on the fresh blocks reserve(end) takes: from the full-context pool and
        from the window pool (0 where there is none)."""
        bs, pool = kv.block_size, kv.window_pool
        full = self._needed(self.block_table, kv.allocator, end, bs)
        return full, 0 if pool is None else self._needed(self.window_table, pool.allocator, end, bs)

    def blocks_held(self, kv: KVCache) -> tuple[int, int]:
        """Blocks this session would give back (an upper bound: shared ones count too)."""
        return len(self.block_table), sum(1 for b in self.window_table if b >= 0)

    def _needed(self, table: list[int], allocator: BlockAllocator, end: int, bs: int) -> int:
        new = max(0, -(-end // bs) - len(table))
        first = self.num_computed // bs
        writable = range(first, min(len(table), -(-end // bs)))
        shared = sum(1 for i in writable if allocator.refcount[table[i]] > 1)
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
            if kv.window_pool is not None and self.window_table[i] >= 0:
                kv.window_pool.allocator.register(self.window_table[i], digest)
        self._slide_window(kv)
