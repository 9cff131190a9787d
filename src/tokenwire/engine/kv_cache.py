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
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tokenwire.model import kernels
from tokenwire.model.config import ModelConfig


def block_hash(previous: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


ROOT_HASH = b"tokenwire-kv"


class OutOfBlocksError(RuntimeError):
    pass


class LowerTier(Protocol):
    """Blocks the prefix cache no longer holds, kept elsewhere (engine/persistence.py: on disk)."""

    def prefetch(self, digests: list[bytes]) -> None:
        """The blocks about to be asked for, in order: start reading them."""

    def load(self, digest: bytes) -> int | None:
        """The block back in a free block, registered under `digest`, unreferenced; or None."""

    def load_tail(self, digest: bytes) -> int | None:
        """A partial block (the positions past a sequence's last full block) back in a block of
        the caller's own (one reference, not in the prefix cache); or None."""

    def finish(self) -> None:
        """The match is over: what was read ahead and not asked for is let go."""


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

    def holds(self, digest: bytes) -> bool:
        """Whether a block with this content is cached (no hit counted, no LRU move)."""
        return digest in self._by_hash

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


# --kv-dtype: how the cache stores keys and values. auto: fp16 for quantised weights (half the
# bytes each decode step reads, the same rounding llama.cpp's default f16 cache makes), else the
# model's dtype (the fp32 path stays exact against transformers). q8: int8 values with an fp16
# scale per 32 (llama.cpp's q8_0 numbers), the scales in tensors of their own.
KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "q8")
Q8_BLOCK = 32
_STORED = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "q8": torch.int8}
_BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "q8": 1 + 2 / Q8_BLOCK}
_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype, quantized: bool) -> str:
    """What `auto` means for a model, and a clear error for a name that is not a KV type."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown --kv-dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return "fp16" if quantized else _OF_DTYPE.get(model_dtype, "fp32")
    return kv_dtype


def check_kv_dtype(kv_dtype: str, config: ModelConfig, device: torch.device | str) -> None:
    if kv_dtype != "q8":
        return
    if config.head_dim % Q8_BLOCK:
        raise ValueError(
            f"--kv-dtype q8 needs a head size that is a multiple of {Q8_BLOCK}; this model's is "
            f"{config.head_dim} (use fp16)"
        )
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"--kv-dtype q8 runs on the CPU (its kernels are tokenwire's own); use fp16 on {device}"
        )


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, layers: int | None = None) -> float:
    """Bytes a position takes in the cache: keys and values of every layer (or of `layers`
    layers), scales included."""
    n = config.num_layers if layers is None else layers
    return 2 * n * config.num_kv_heads * config.head_dim * _BYTES_PER_VALUE[kv_dtype]


def as_stored(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """x [..., D] rounded as a `kv_dtype` cache stores it and read back in x's dtype: what a
    forward without the cache (GraphPipe's dense batch) attends to, to match the engine's."""
    if kv_dtype == "fp32":
        return x
    if kv_dtype != "q8":
        return x.to(_STORED[kv_dtype]).to(x.dtype)
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)  # kernels/kv_store.h's arithmetic
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (d.half().float() * q).reshape(x.shape).to(x.dtype)


class KVPool:
    """Blocks of keys and values for some of the model's layers, [layers, blocks, block_size,
    kv_heads, head_dim] in the `kv_dtype`'s storage (int8 for q8, with scales [.., D/32]), and
    the allocator that hands out their blocks."""

    def __init__(
        self, layers: int, num_blocks: int, block_size: int, config: ModelConfig, kv_dtype: str, device: Any
    ) -> None:
        shape = (layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=_STORED[kv_dtype], device=device)
        self.v = torch.zeros(shape, dtype=_STORED[kv_dtype], device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_dtype == "q8":
            scales = (*shape[:-1], config.head_dim // Q8_BLOCK)
            self.k_scale = torch.zeros(scales, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(scales, dtype=torch.float16, device=device)
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)

    def copy_block(self, src: int, dst: int) -> None:
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, dst].copy_(t[:, src])


class KVCache:
    """Key/value storage for every layer. Layers attending to all earlier positions share one
    pool of blocks (`k`, `v`, `allocator`: a block holds its positions for all of them). Where
    `windows` gives some layers a sliding window and `window_blocks` is set, those layers keep
    their keys and values in a second pool (`window_pool`) from which a sequence holds only the
    blocks its window still reaches (engine/session.py lets the older ones go): Gemma 3's five
    local layers in six then cost a window's worth of positions, not the whole context."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: str,
        device: torch.device | str,
        windows: Sequence[int | None] = (),
        window_blocks: int = 0,
    ) -> None:
        check_kv_dtype(kv_dtype, config, device)
        windowed = [i for i, w in enumerate(windows) if w is not None] if window_blocks else []
        if len(windowed) == config.num_layers:  # every layer windowed (Mistral): one pool, as before
            windowed = []
        full = [i for i in range(config.num_layers) if i not in windowed]
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        pool = KVPool(len(full), num_blocks, block_size, config, kv_dtype, device)
        self.pool = pool
        # the full-context pool's storage and allocator, under the names every path uses
        self.k, self.v, self.k_scale, self.v_scale = pool.k, pool.v, pool.k_scale, pool.v_scale
        self.allocator = pool.allocator
        self.window: int | None = None  # the window the second pool keeps (its layers' widest)
        self.window_pool: KVPool | None = None
        self._where: dict[int, tuple[KVPool, int]] = {layer: (pool, i) for i, layer in enumerate(full)}
        if windowed:
            self.window = max(int(windows[i]) for i in windowed)  # type: ignore[arg-type]
            self.window_pool = KVPool(len(windowed), window_blocks, block_size, config, kv_dtype, device)
            self._where |= {layer: (self.window_pool, i) for i, layer in enumerate(windowed)}
        # each layer's place for the fused kernel: s >= 0 layer s of the full-context pool, s < 0
        # layer -s - 1 of the window pool (kernels/decode_stack.h)
        places = [self._where[layer] for layer in range(config.num_layers)]
        self.layer_slots = torch.tensor([i if p is pool else -i - 1 for p, i in places], dtype=torch.long)
        self.bytes_per_token = kv_bytes_per_token(config, kv_dtype, len(full))
        # where a prefix-cache miss looks next: blocks read back from disk (engine/persistence.py;
        # only without a window pool)
        self.lower_tier: LowerTier | None = None
        self.window_bytes_per_token = kv_bytes_per_token(config, kv_dtype, len(windowed))

    def has_room(self, needed: Sequence[int], extra: Sequence[int] = (0, 0)) -> bool:
        """Whether `needed` blocks (full-context pool, window pool) are available, counting
        `extra` blocks as if given back."""
        if self.allocator.num_available + extra[0] < needed[0]:
            return False
        return self.window_pool is None or self.window_pool.allocator.num_available + extra[1] >= needed[1]

    def windowed(self, layer: int) -> bool:
        """Whether `layer`'s keys and values live in the window pool (addressed by window tables)."""
        return self.window_pool is not None and self._where[layer][0] is self.window_pool

    def first_needed_block(self, position: int) -> int:
        """The first window block a query at `position` or later may read."""
        assert self.window is not None
        return max(0, position - self.window + 1) // self.block_size

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, kv_dtype: str, layers: int | None = None
    ) -> float:
        return block_size * kv_bytes_per_token(config, kv_dtype, layers)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return as_stored(x, self.kv_dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys and values [n, kv_heads, D] into `slots` of one layer, stored as the fused
        step stores them (kernels/kv_store.h): torch's rounding to fp16/bf16 is the same."""
        pool, i = self._where[layer]
        for cache, scales, rows in ((pool.k, pool.k_scale, k), (pool.v, pool.v_scale, v)):
            layer_cache = cache[i]
            if scales is None:
                layer_cache.view(-1, *layer_cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))
            else:
                kernels.ops().kv_store(layer_cache, scales[i], slots, rows)

    def read(
        self, layer: int, blocks: torch.Tensor | slice, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` of one layer in `dtype`: [n, block_size, kv_heads, D] each."""
        out = []
        pool, i = self._where[layer]
        for cache, scales in ((pool.k, pool.k_scale), (pool.v, pool.v_scale)):
            stored = cache[i][blocks]
            if scales is None:
                out.append(stored.to(dtype))
            else:  # a q8 value is its fp16 scale times its integer, one rounding (as the kernel)
                s = scales[i][blocks].float().repeat_interleave(Q8_BLOCK, dim=-1)
                out.append((s * stored.float()).to(dtype))
        return out[0], out[1]
