"""BlockAllocator and the session's use of it: reference counts, copy-on-write, prefix-cache eviction."""

from __future__ import annotations

import pytest
import torch

from tokenwire.engine.kv_cache import ROOT_HASH, BlockAllocator, KVCache, OutOfBlocksError, block_hash
from tokenwire.engine.session import Session
from tokenwire.model.config import ModelConfig

TINY = ModelConfig("LlamaForCausalLM", 100, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)


def digest(*tokens: int) -> bytes:
    return block_hash(ROOT_HASH, list(tokens))


def test_refcounts_free_a_block_only_when_the_last_holder_lets_go() -> None:
    alloc = BlockAllocator(3)
    a = alloc.allocate()
    assert alloc.refcount[a] == 1 and alloc.num_available == 2
    alloc.incref(a)
    alloc.decref(a)
    assert alloc.num_available == 2  # still held once
    alloc.decref(a)
    assert alloc.num_available == 3
    with pytest.raises(AssertionError, match="released twice"):
        alloc.decref(a)


def test_allocation_fails_when_every_block_is_referenced() -> None:
    alloc = BlockAllocator(2)
    alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    alloc = BlockAllocator(3)
    blocks = [alloc.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        alloc.register(block, digest(i))
    for block in blocks:
        alloc.decref(block)  # unreferenced but cached, in release order 0, 1, 2
    assert alloc.num_available == 3 and alloc.num_cached == 3
    assert alloc.lookup(digest(0)) == blocks[0]  # a hit makes block 0 the most recently used
    assert alloc.hits == 1
    assert alloc.allocate() == blocks[1]  # the least recently used goes first
    assert alloc.lookup(digest(1)) is None  # ... and its hash with it
    assert alloc.allocate() == blocks[2]
    assert alloc.allocate() == blocks[0]
    assert alloc.num_cached == 0


def test_a_cached_block_in_use_is_never_evicted() -> None:
    alloc = BlockAllocator(2)
    kept, other = alloc.allocate(), alloc.allocate()
    alloc.register(kept, digest(7))
    alloc.decref(kept)
    alloc.incref(alloc.lookup(digest(7)))  # a prefix-cache hit takes it back
    alloc.decref(other)
    assert alloc.allocate() == other
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()
    assert alloc.lookup(digest(7)) == kept


def test_unregister_returns_an_unreferenced_cached_block_to_the_free_list() -> None:
    alloc = BlockAllocator(1)
    block = alloc.allocate()
    alloc.register(block, digest(1))
    alloc.unregister(block)  # about to be overwritten: its content no longer matches the hash
    assert alloc.lookup(digest(1)) is None
    alloc.decref(block)
    assert alloc.num_available == 1 and alloc.num_cached == 0


def _filled(kv: KVCache, tokens: list[int]) -> Session:
    session = Session("s", tokens=list(tokens))
    session.reserve(len(tokens), kv)
    for i, block in enumerate(session.block_table):
        kv.k[:, block] = float(i + 1)  # stands for the computed keys of block i
    session.computed(len(tokens), kv)
    return session


def test_fork_shares_blocks_and_a_write_copies_the_shared_one() -> None:
    kv = KVCache(TINY, 8, 4, "fp32", "cpu")
    parent = _filled(kv, list(range(1, 7)))  # 6 tokens: one full block, one partial
    child = parent.fork("c", 6, kv)
    assert child.block_table == parent.block_table
    assert [kv.allocator.refcount[b] for b in parent.block_table] == [2, 2]
    child.tokens.append(50)
    assert child.blocks_needed(7, kv) == (1, 0)  # the shared partial block must be copied
    child.reserve(7, kv)
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    copied = child.block_table[1]
    assert copied != parent.block_table[1]
    assert kv.allocator.refcount[parent.block_table[1]] == 1
    assert torch.equal(kv.k[:, copied], kv.k[:, parent.block_table[1]])  # the copy holds the KV
    child.release(kv)
    parent.release(kv)
    assert kv.allocator.num_available == 8


def test_full_blocks_are_found_again_by_their_token_prefix() -> None:
    kv = KVCache(TINY, 8, 4, "fp32", "cpu")
    first = _filled(kv, list(range(1, 10)))  # two full blocks registered
    first.release(kv)
    again = Session("t", tokens=[*range(1, 9), 99, 98])
    assert again.match_prefix(len(again.tokens) - 1, kv) == 8
    assert again.num_computed == 8 and kv.allocator.hits == 2
    other = Session("u", tokens=[2, 1, 3, 4, 5, 6, 7, 8, 9])  # same tokens, different prefix
    assert other.match_prefix(8, kv) == 0
