"""The GGUF weight types tokenwire's kernels run, one row each: the Python mirror of the C++
table (model/kernels/type_table.h), read by quant.py (packed shapes, the split-row repacking) and
gguf.py (which types a conversion keeps as they are). tests/model/test_weight_types.py checks the
two tables agree, through the kernels' `weight_type_info` op.

Adding a type: a header and a row in C++ (type_table.h says what they hold) and its row here:
name, GGUF type id, weights per block, the split-row layout (the parts of a block in GGUF's
order, with their bytes), the activation format its integer dot takes (the C++ format's name)
and a numpy reference dequantiser (the tests compare it with gguf's and with the kernels').
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, pairwise

import numpy as np
import torch


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block [n, bytes], as float32 [n, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(quants: np.ndarray) -> np.ndarray:
    """16 quant bytes per block -> 32 values: low nibbles are weights 0..15, high ones 16..31."""
    return np.concatenate([quants & 0x0F, quants >> 4], axis=1).astype(np.float32)


# Each reference: GGUF blocks [n, block_bytes] uint8 -> float32 [n, block], rounding as the
# kernels and gguf do (d*q is exact in float32, so d*q+m rounds once).
def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0) * (_nibbles(blocks[:, 2:18]) - np.float32(8))


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0) * _nibbles(blocks[:, 4:20]) + _halves(blocks, 2)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0) * blocks[:, 2:34].view(np.int8).astype(np.float32)


def _q5(qh_qs: np.ndarray) -> np.ndarray:
    """A Q5 block's 20 bytes (4 of high bits, little-endian, then 16 nibble bytes) -> its 32
    values 0..31: bit i of the high bits is the fifth bit of weight i."""
    high = np.unpackbits(qh_qs[:, :4], axis=1, bitorder="little").astype(np.float32)
    return _nibbles(qh_qs[:, 4:20]) + np.float32(16) * high


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0) * (_q5(blocks[:, 2:22]) - np.float32(16))


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0) * _q5(blocks[:, 4:24]) + _halves(blocks, 2)


# IQ4_NL's non-linear table (ggml's kvalues_iq4nl): nibble n weighs d * IQ4_VALUES[n]
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    indices = np.concatenate([blocks[:, 2:18] & 0x0F, blocks[:, 2:18] >> 4], axis=1)
    return _halves(blocks, 0) * IQ4_VALUES[indices]


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """d, scales_h (uint16: 2 bits a sub-block), scales_l (4 bytes: a nibble a sub-block), 8
    sub-blocks of 16 IQ4_NL nibble bytes: sub-block t weighs (d * (ls_t - 32)) * IQ4_VALUES[n]."""
    n = len(blocks)
    low = np.stack([blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4], axis=2).reshape(n, 8)
    high = blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16)) & 3
    scales = _halves(blocks, 0) * ((low | high << 4).astype(np.float32) - np.float32(32))  # [n, 8]
    quants = blocks[:, 8:136].reshape(n, 8, 16)
    indices = np.concatenate([quants & 0x0F, quants >> 4], axis=2)  # [n, 8, 32]
    return (scales[:, :, None] * IQ4_VALUES[indices]).reshape(n, 256)


def _f16(blocks: np.ndarray) -> np.ndarray:
    return _halves(blocks, 0)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    """bfloat16: the top half of a float32's bits."""
    return (blocks.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class WeightType:
    name: str
    gguf_id: int  # GGML type id
    block: int  # weights per block
    # the split-row layout: a block's parts (name, bytes per block) in GGUF's order; a row in
    # memory holds each part for all its blocks before the next part (split_rows)
    parts: tuple[tuple[str, int], ...]
    activation: str  # the activation format its integer dot takes (type_table.h's row; "": none)
    reference: Callable[[np.ndarray], np.ndarray]  # GGUF blocks [n, bytes] -> float32 [n, block]

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.parts)

    def packed_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The GGUF bytes of a [out_features, in_features] weight (the split form is as large)."""
        if in_features % self.block:
            raise ValueError(
                f"{in_features} input features are not a multiple of the {self.block}-weight block"
            )
        return out_features, in_features // self.block * self.block_bytes

    def split_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """GGUF blocks [N, nb * block_bytes] -> the kernels' row form: per row each part of its
        nb blocks (e.g. Q4_1: the nb fp16 scales, the nb fp16 minimums, the nb blocks' quants)."""
        return self.split_rows_into(packed, torch.empty_like(packed))

    def split_rows_into(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """split_rows written into `out` (same shape; its final place, e.g. the weight arena:
        no temporary as large as the tensor)."""
        n, row_bytes = packed.shape
        if tuple(out.shape) != (n, row_bytes) or out.dtype != packed.dtype:
            got = f"{out.dtype} {tuple(out.shape)}"
            raise ValueError(f"split rows of {packed.dtype} {(n, row_bytes)} cannot go into {got}")
        nb = row_bytes // self.block_bytes
        blocks = packed.reshape(n, nb, self.block_bytes)
        bounds = pairwise(accumulate((size for _, size in self.parts), initial=0))
        for a, b in bounds:
            out[:, nb * a : nb * b].view(n, nb, b - a).copy_(blocks[:, :, a:b])
        return out

    def dequantize_reference(self, packed: np.ndarray) -> np.ndarray:
        """GGUF blocks [N, nb * block_bytes] -> float32 [N, nb * block] (numpy, for tests)."""
        n = packed.shape[0]
        blocks = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1, self.block_bytes)
        return self.reference(blocks).reshape(n, -1)


Q4_0 = WeightType("Q4_0", 2, 32, (("d", 2), ("qs", 16)), "i16_q4_pairs", _q4_0)
Q4_1 = WeightType("Q4_1", 3, 32, (("d", 2), ("m", 2), ("qs", 16)), "i16_q4_pairs", _q4_1)
Q8_0 = WeightType("Q8_0", 8, 32, (("d", 2), ("qs", 32)), "i16_q8_even_odd", _q8_0)
# Q5's high bits and nibbles stay together in the split row: the pair dot reads both (types_q5_iq4.h)
Q5_0 = WeightType("Q5_0", 6, 32, (("d", 2), ("qh_qs", 20)), "i16_byte_pairs", _q5_0)
Q5_1 = WeightType("Q5_1", 7, 32, (("d", 2), ("m", 2), ("qh_qs", 20)), "i16_byte_pairs", _q5_1)
IQ4_NL = WeightType("IQ4_NL", 20, 32, (("d", 2), ("qs", 16)), "i16_byte_pairs", _iq4_nl)
IQ4_XS = WeightType(
    "IQ4_XS", 23, 256, (("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)), "i16_byte_pairs", _iq4_xs
)
# float matrices: a "block" of one value; no integer dot (fp32 activations, types_float.h)
F16 = WeightType("F16", 1, 1, (("value", 2),), "", _f16)
BF16 = WeightType("BF16", 30, 1, (("value", 2),), "", _bf16)

WEIGHT_TYPES: tuple[WeightType, ...] = (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, IQ4_XS, F16, BF16)
BY_ID: dict[int, WeightType] = {t.gguf_id: t for t in WEIGHT_TYPES}
BY_NAME: dict[str, WeightType] = {t.name: t for t in WEIGHT_TYPES}


def weight_type(gguf_id: int) -> WeightType:
    """The row of a GGUF type id; ValueError for a type the kernels do not run."""
    try:
        return BY_ID[int(gguf_id)]
    except KeyError:
        raise ValueError(f"unsupported quantisation type {gguf_id}") from None
