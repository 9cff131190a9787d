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


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales [n, 12] -> (scales, minimums) as float32 [n, 8, 1]:
    entries 0..3 are the low 6 bits of bytes 0..3 (minimums: 4..7); entries 4..7 the low (high)
    nibbles of bytes 8..11 with the top two bits of bytes 0..3 (4..7) above them."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    minimums = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return scales.astype(np.float32)[:, :, None], minimums.astype(np.float32)[:, :, None]


def _k45(blocks: np.ndarray, high_bits: bool) -> np.ndarray:
    """Q4_K (d, dmin, 12 scale bytes, 128 qs) and Q5_K (the same with 32 qh bytes before qs):
    sub-block s of 32 is (d * sc[s]) * q - dmin * m[s]; its 4-bit q are the low (s even) or high
    nibbles of qs chunk s // 2, Q5_K's fifth bit is bit s of qh byte i."""
    n = blocks.shape[0]
    scales, minimums = _k4_scales(blocks[:, 4:16])
    start = 48 if high_bits else 16
    chunks = blocks[:, start : start + 128].reshape(n, 4, 1, 32)
    q = ((chunks >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F).reshape(n, 8, 32)
    if high_bits:
        bits = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        q = q | (bits << 4)
    scale = _halves(blocks, 0)[:, :, None] * scales
    minimum = _halves(blocks, 2)[:, :, None] * minimums
    return (scale * q.astype(np.float32) - minimum).reshape(n, 256)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    return _k45(blocks, high_bits=False)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    return _k45(blocks, high_bits=True)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K (128 ql, 64 qh, 16 int8 scales, fp16 d): weight r of a 128-weight half is nibble
    r // 64 of ql byte r % 64 with bits 2 * (r // 32) of qh byte r % 32 above, minus 32, times
    d * scale[16-weight sub-block]."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, 128]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).astype(np.float32) - np.float32(32)
    scale = _halves(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return (scale[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def _k23_low_bits(packed: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 qs bytes [n, 64] -> 2-bit q [n, 256]: weight 32t + i of each 128-weight half
    is bits 2t.. of byte i of the half's 32."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return ((packed.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K (16 scale bytes, 64 qs, fp16 d, dmin): sub-block s of 16 is (d * (scale[s] & 15)) * q
    - dmin * (scale[s] >> 4)."""
    n = blocks.shape[0]
    scales = blocks[:, :16]
    q = _k23_low_bits(blocks[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
    scale = _halves(blocks, 80) * (scales & 0x0F).astype(np.float32)
    minimum = _halves(blocks, 82) * (scales >> 4).astype(np.float32)
    return (scale[:, :, None] * q - minimum[:, :, None]).reshape(n, 256)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K (32 hmask, 64 qs, 12 scale bytes, fp16 d): weight 32g + i is its 2 bits less 4 where
    bit g of hmask byte i is clear, times d * (6-bit scale - 32) of its 16; scale s's low nibble
    is byte s % 8's (high for s >= 8), its two high bits bits 2 * (s // 4) of byte 8 + s % 4."""
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=1)
    high = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.float32) - np.float32(32)
    bits = (blocks[:, None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, g, i]
    q = _k23_low_bits(blocks[:, 32:96]).astype(np.float32) - 4 * (1 - bits.reshape(n, 256)).astype(np.float32)
    scale = _halves(blocks, 108) * scales
    return (scale[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


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
    # runs in tiles.h's register-tiled int8 kernels (AVX2 and AVX-512, every number of rows)
    tiled: bool = False

    @property
    def block_bytes(self) -> int:
        return sum(size for _, size in self.parts)

    @property
    def wide_head(self) -> bool:
        """Whether an lm_head of this type takes the wide (~15-bit) activations (QuantLinear's
        `wide`). The 32-weight types: llama.cpp multiplies them with int8 activations a scale
        per 32 (Q8_0 / Q8_1), as fine as ours, and on the shipped model the head's rounding was
        the largest share of the gap to the exact model (docs/engine.md). The 256-weight types
        (K-quants, IQ4_XS) it multiplies with Q8_K, a scale per 256: our int8 a scale per 32 is
        finer already, and the wide head's second row cost a 128,256 x 2,048 Q6_K head 0.8 ms
        (AVX-512) and 1.7 ms (AVX2) a token, 4-8% of a llama-1b decode step."""
        return self.block == 32

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


Q4_0 = WeightType("Q4_0", 2, 32, (("d", 2), ("qs", 16)), "i8_32", _q4_0, tiled=True)
Q4_1 = WeightType("Q4_1", 3, 32, (("d", 2), ("m", 2), ("qs", 16)), "i8_32", _q4_1, tiled=True)
Q8_0 = WeightType("Q8_0", 8, 32, (("d", 2), ("qs", 32)), "i8_32", _q8_0, tiled=True)
# Q5's high bits and nibbles stay together in the split row: a tile unit reads both (tiles_types.h)
Q5_0 = WeightType("Q5_0", 6, 32, (("d", 2), ("qh_qs", 20)), "i8_32", _q5_0, tiled=True)
Q5_1 = WeightType("Q5_1", 7, 32, (("d", 2), ("m", 2), ("qh_qs", 20)), "i8_32", _q5_1, tiled=True)
IQ4_NL = WeightType("IQ4_NL", 20, 32, (("d", 2), ("qs", 16)), "i8_32", _iq4_nl, tiled=True)
IQ4_XS = WeightType(
    "IQ4_XS", 23, 256, (("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)), "i8_32", _iq4_xs, tiled=True
)
# float matrices: a "block" of one value; no integer dot (fp32 activations, types_float.h)
F16 = WeightType("F16", 1, 1, (("value", 2),), "", _f16)
BF16 = WeightType("BF16", 30, 1, (("value", 2),), "", _bf16)

# K-quants: 256-weight super-blocks, kept as the file's blocks (one part; types_k.h measures why)
Q4_K = WeightType("Q4_K", 12, 256, (("block", 144),), "i8_32", _q4_k, tiled=True)
Q6_K = WeightType("Q6_K", 14, 256, (("block", 210),), "i8_32", _q6_k, tiled=True)
Q5_K = WeightType("Q5_K", 13, 256, (("block", 176),), "i8_32", _q5_k, tiled=True)

Q3_K = WeightType("Q3_K", 11, 256, (("block", 110),), "i16_even_odd16", _q3_k)
Q2_K = WeightType("Q2_K", 10, 256, (("block", 84),), "i16_even_odd16", _q2_k)

WEIGHT_TYPES: tuple[WeightType, ...] = (
    Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, IQ4_XS, F16, BF16, Q4_K, Q6_K, Q5_K, Q3_K, Q2_K
)  # fmt: skip
BY_ID: dict[int, WeightType] = {t.gguf_id: t for t in WEIGHT_TYPES}
BY_NAME: dict[str, WeightType] = {t.name: t for t in WEIGHT_TYPES}


def weight_type(gguf_id: int) -> WeightType:
    """The row of a GGUF type id; ValueError for a type the kernels do not run."""
    try:
        return BY_ID[int(gguf_id)]
    except KeyError:
        raise ValueError(f"unsupported quantisation type {gguf_id}") from None
