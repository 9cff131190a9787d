"""Paged KV cache: block storage tensors and the block allocator with its prefix cache.

Blocks hold `block_size` consecutive token positions of one sequence. They are reference
counted so forks and prefix-cache hits share them. A *full* block can be registered under the
hash of the whole token prefix it ends (the previous block's hash chained with its own
tokens); a later sequence whose tokens hash the same reuses the block instead of recomputing
it. Registered blocks nobody references stay cached until memory is needed, then are evicted
least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import torch

from tokenwire.model.config import ModelConfig


def block_hash(previous: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


ROOT_HASH = b"tokenwire-kv"


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.hits = 0  # lookups that found a cached block

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise OutOfBlocksError("no free KV blocks")
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._evictable.pop(block, None)
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] < 0:
            raise AssertionError(f"block {block} released twice")
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, digest: bytes) -> int | None:
        block = self._by_hash.get(digest)
        if block is not None:
            self.hits += 1
            if block in self._evictable:
                self._evictable.move_to_end(block)
        return block

    def register(self, block: int, digest: bytes) -> None:
        if digest in self._by_hash or block in self._hash_of:
            return  # an identical block is already cached, or this one already is
        self._by_hash[digest] = block
        self._hash_of[block] = digest

    def unregister(self, block: int) -> None:
        """The block is about to be overwritten: it no longer holds its hashed content."""
        if block in self._hash_of:
            self._forget(block)
            if self.refcount[block] == 0:
                self._evictable.pop(block, None)
                self._free.append(block)

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        del self._by_hash[digest]


class KVCache:
    """Key/value storage for every layer: [layers, blocks, block_size, kv_heads, head_dim]."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
