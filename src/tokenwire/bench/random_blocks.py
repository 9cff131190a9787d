"""Valid random GGUF blocks of the types gguf-py cannot quantise (the K-quants): random bytes with
finite fp16 scales written where the type keeps them, and an all-zero first block. For the
kernel tests (tests/model) and `tokenwire bench gemm`."""

from __future__ import annotations

import numpy as np

from tokenwire.model.weight_types import WeightType

# byte offsets of each type's fp16 fields (d, dmin) in its GGUF block
HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# the bytes of a block holding its quants (zeroed, a block weighs its offset alone)
QUANTS = {"Q2_K": (16, 80), "Q3_K": (0, 96), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def random_blocks(
    rows: int, cols: int, wt: WeightType, seed: int = 0, magnitude: tuple[float, float] = (1e-7, 0.1)
) -> np.ndarray:
    """uint8 [rows, cols / block * block_bytes]: each fp16 field a random sign times a magnitude
    log-uniform in `magnitude` (the default reaches fp16 subnormals); block 0 all zero."""
    rng = np.random.default_rng(seed)
    n = rows * cols // wt.block
    blocks = rng.integers(0, 256, (n, wt.block_bytes), dtype=np.uint8)
    low, high = np.log(magnitude)
    for start in HALVES[wt.name]:
        halves = (rng.choice([-1.0, 1.0], n) * np.exp(rng.uniform(low, high, n))).astype(np.float16)
        blocks[:, start : start + 2] = halves.view(np.uint8).reshape(n, 2)
    blocks[0] = 0
    return blocks.reshape(rows, -1)
