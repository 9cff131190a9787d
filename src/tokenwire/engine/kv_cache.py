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

from tokenwire.model import kernels
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


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> float:
    """Bytes a position takes in the cache: keys and values of every layer, scales included."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * _BYTES_PER_VALUE[kv_dtype]


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


class KVCache:
    """Key/value storage for every layer: [layers, blocks, block_size, kv_heads, head_dim] in the
    `kv_dtype`'s storage (int8 for q8, with scales [layers, blocks, block_size, kv_heads, D/32])."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: str,
        device: torch.device | str,
    ) -> None:
        check_kv_dtype(kv_dtype, config, device)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_dtype = kv_dtype
        self.k = torch.zeros(shape, dtype=_STORED[kv_dtype], device=device)
        self.v = torch.zeros(shape, dtype=_STORED[kv_dtype], device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_dtype == "q8":
            scales = (*shape[:-1], config.head_dim // Q8_BLOCK)
            self.k_scale = torch.zeros(scales, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(scales, dtype=torch.float16, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bytes_per_token = kv_bytes_per_token(config, kv_dtype)
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str) -> float:
        return block_size * kv_bytes_per_token(config, kv_dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return as_stored(x, self.kv_dtype)

    def copy_block(self, src: int, dst: int) -> None:
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, dst].copy_(t[:, src])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys and values [n, kv_heads, D] into `slots` of one layer, stored as the fused
        step stores them (kernels/kv_store.h): torch's rounding to fp16/bf16 is the same."""
        for cache, scales, rows in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            layer_cache = cache[layer]
            if scales is None:
                layer_cache.view(-1, *layer_cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))
            else:
                kernels.ops().kv_store(layer_cache, scales[layer], slots, rows)

    def read(
        self, layer: int, blocks: torch.Tensor | slice, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` of one layer in `dtype`: [n, block_size, kv_heads, D] each."""
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            stored = cache[layer][blocks]
            if scales is None:
                out.append(stored.to(dtype))
            else:  # a q8 value is its fp16 scale times its integer, one rounding (as the kernel)
                s = scales[layer][blocks].float().repeat_interleave(Q8_BLOCK, dim=-1)
                out.append((s * stored.float()).to(dtype))
        return out[0], out[1]
