"""Where a quantised model's packed weights live: anonymous mappings backed by transparent huge
pages, written once at load (each tensor directly into its place: no second copy).

A decode step streams every weight once (96 MB for SmolLM2's GGUF). On 4 KiB pages that is a
TLB miss every 4 KiB; on 2 MiB pages the stream runs faster: measured on this machine (2 threads
summing a 96 MiB buffer, best of 20) 20.9-22.5 GB/s on 4 KiB pages against 27.5-29.8 GB/s on huge
pages. Linux hands out huge pages for anonymous memory only where asked (`madvise` mode of
/sys/kernel/mm/transparent_hugepage/enabled, the common default), so each mapping is advised
with MADV_HUGEPAGE before it is touched. Where the kernel gives small pages anyway (THP off, no
free huge pages) the weights still load, on small pages.

The arena grows by chunks of CHUNK bytes (a tensor larger than that gets a chunk of its own
size), so nothing needs the model's total size in advance; a chunk's unused tail is never
touched and so never resident, except the huge page the last tensor ends in. So chunks are
large: an 8B Q4_K_M (FFN matrices of 63 MiB) in 64 MiB chunks took a chunk per matrix and left
68 MiB of half-used huge pages resident; in 512 MiB chunks, 6 MiB.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 512 << 20
_ALIGN = 64  # each tensor starts on a cache line


def huge_pages_available() -> bool:
    """Whether this kernel may back an madvise'd mapping with transparent huge pages."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


class WeightArena:
    """A bump allocator over anonymous mappings; keep it alive as long as its tensors."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.huge = huge_pages_available()
        self.mappings: list[mmap.mmap] = []
        self._memory: torch.Tensor | None = None  # the current chunk, as bytes
        self._used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised contiguous tensor in the arena."""
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        size = -(-nbytes // _ALIGN) * _ALIGN
        if self._memory is None or self._used + size > self._memory.numel():
            self._new_chunk(max(self.chunk, size))
        assert self._memory is not None
        at = self._used
        self._used += size
        return self._memory[at : at + nbytes].view(dtype).view(shape)

    def _new_chunk(self, size: int) -> None:
        # private anonymous memory (Python's default for -1 is shared, i.e. shmem, whose huge-page
        # policy is separate and usually off); the slack aligns the start to 2 MiB
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.huge:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults take huge pages
        self.mappings.append(mapping)
        memory = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -memory.data_ptr() % HUGE_PAGE
        self._memory, self._used = memory[start : start + size], 0

    @property
    def reserved_bytes(self) -> int:
        return sum(len(m) for m in self.mappings)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim) once a load is done:
    what building the model allocated and freed stays resident otherwise, before the KV cache's
    allocation sets the start's peak (gguf_weights' read buffers are mappings of their own;
    still, without the trim SmolLM2's start peaked 30 MiB higher, the 1B shape's 31), and each
    streamed layer's fp32 weights once dropped (families.build_model's `stream_layers`: without
    it OLMoE-1B-7B's reference grew 1 GB a layer, 18.2 GB after 16 of them; with it, 1.06 GB
    between layers and 3.2 GB at the peak). Elsewhere than glibc: nothing."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
