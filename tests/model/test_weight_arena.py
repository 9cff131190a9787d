"""The weight arena's memory: what is resident is what was written, give or take a huge page per
chunk (model/weight_arena.py)."""

from __future__ import annotations

import ctypes
import mmap

import torch

from tokenwire.model.weight_arena import HUGE_PAGE, WeightArena


def resident_bytes(arena: WeightArena) -> int:
    """Resident bytes of the arena's mappings, page by page (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for m in arena.mappings:
        start = torch.frombuffer(m, dtype=torch.uint8).data_ptr()  # page-aligned: mmap's own
        pages = -(-len(m) // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(len(m)), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        total += sum(v & 1 for v in vec) * page
    return total


def test_a_layer_stack_of_large_matrices_leaves_little_resident_beyond_what_was_written() -> None:
    """Four layers of an 8B Q4_K_M's packed rows (q and o 9 MiB, k and v 2.25 MiB, three FFN
    matrices of 63 MiB): resident is what was written plus at most a huge page in each of the few
    chunks. 64 MiB chunks took 16 here, most ending in a half-used huge page."""
    arena = WeightArena()
    written = 0
    for _ in range(4):
        for rows in (4096, 1024, 1024, 4096, 28672, 28672, 28672):
            arena.take((rows, 2304)).fill_(1)
            written += rows * 2304
    assert len(arena.mappings) <= -(-written // arena.chunk) + 1
    assert written <= resident_bytes(arena) <= written + len(arena.mappings) * HUGE_PAGE
