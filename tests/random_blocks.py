"""What a random block weighs with its quants zeroed (the generator: tokenwire.bench.random_blocks)."""

from __future__ import annotations

import numpy as np

from tokenwire.bench.random_blocks import QUANTS
from tokenwire.model.weight_types import WeightType


def offsets(packed: np.ndarray, wt: WeightType) -> np.ndarray:
    """What each weight of `packed` weighs with its quants zeroed: the part of it an integer dot
    leaves to the activations' sums (-dmin*m; Q6_K's -32 d*scale)."""
    blocks = packed.reshape(-1, wt.block_bytes).copy()
    start, end = QUANTS[wt.name]
    blocks[:, start:end] = 0
    return wt.dequantize_reference(blocks.reshape(packed.shape))
