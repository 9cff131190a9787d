"""Weights kept in GGUF's block quantisation (the types of weight_types.py), run by our CPU kernels.

A quantised weight is the GGUF's own bytes: a contiguous uint8 tensor [out_features,
in_features / block * block_bytes], one row of blocks per output feature, exactly as in the file
(q/k rows un-permuted like the fp32 path); that is what `quantize`, `dequantize` and the
conversion cache hold. In memory, QuantLinear and QuantEmbedding keep each row split
(`split_rows`: the row's scales, then its minimums, then its quants; the same bytes), the form
our kernels read: the decode matvec converts and applies eight blocks' scales at once (the
K-quants keep their 256-weight super-blocks as the file has them: a one-part layout).
Nothing is re-quantised for these types: the
kernels dequantise bit-exactly as gguf's reference dequantiser does. Other GGUF types
(IQ-quants...) are converted once, at GGUF conversion, to Q8_0 from their dequantised values, as
is a fused projection whose parts differ in type (weights.py); a
Hugging Face directory is quantised at load with `--weights int8` (Q8_0) or `int4` (Q4_1).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from torch import nn

from tokenwire.model import weight_types
from tokenwire.model.kernels import ops
from tokenwire.model.weight_types import weight_type

# GGML type ids and names, from the weight-type table
Q4_0, Q4_1, Q8_0 = weight_types.Q4_0.gguf_id, weight_types.Q4_1.gguf_id, weight_types.Q8_0.gguf_id
QTYPE_NAMES = {t.gguf_id: t.name for t in weight_types.WEIGHT_TYPES}
QTYPES = {t.name: t.gguf_id for t in weight_types.WEIGHT_TYPES}

# From this many rows on, a matmul dequantises the whole weight into fp32 and runs one GEMM:
# the dequantisation is paid once for many rows and MKL's GEMM catches up with our register
# tile there (CPU time on one core, Q4_1: 3072x576 at M=96 5.7 ms ours vs 10.6 dense, M=256
# 13.8 vs 13.9, M=512 32.9 vs 25.3; 576x1536 at M=256 7.9 vs 5.4).
DENSE_FROM_ROWS = 256


def _ops():
    return ops()


def packed_shape(out_features: int, in_features: int, qtype: int) -> tuple[int, int]:
    return weight_type(qtype).packed_shape(out_features, in_features)


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 [N, K] -> packed blocks, with gguf's reference quantiser (the llama.cpp rounding)."""
    shape = packed_shape(*weight.shape, qtype)  # names a bad feature count before gguf does
    array = weight.detach().float().cpu().numpy()
    packed = gguf_quantize(np.ascontiguousarray(array), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(packed)).view(torch.uint8).reshape(shape)


def split_rows(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks [N, nb * block_bytes] -> the kernels' row form (the type's split layout)."""
    return weight_type(qtype).split_rows(packed)


def _dequantize_split(
    split: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    empty = torch.empty(0, dtype=torch.long)
    return _ops().dequantize(split, qtype, in_features, empty if rows is None else rows)


def dequantize(
    packed: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed blocks -> fp32 [rows, in_features], bit-exact with gguf's dequantiser."""
    packed = torch.as_tensor(packed)
    expected = packed_shape(packed.shape[0], in_features, qtype)  # names a bad feature count first
    if packed.dim() != 2 or packed.shape[1] != expected[1]:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not hold {in_features} features")
    return _dequantize_split(split_rows(packed, qtype), qtype, in_features, rows)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W in GGUF blocks; fp32 activations and accumulation."""

    def __init__(
        self,
        packed: torch.Tensor,
        qtype: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        *,
        split: bool = False,
    ):
        """`packed`: GGUF blocks, or with `split` rows already in split_rows' form (a tied
        table's buffer, shared)."""
        super().__init__()
        expected = packed_shape(packed.shape[0], in_features, qtype)
        if tuple(packed.shape) != expected or packed.dtype != torch.uint8:
            raise ValueError(f"packed weight {tuple(packed.shape)} {packed.dtype} is not uint8 {expected}")
        self.register_buffer("packed", packed.contiguous() if split else split_rows(packed, qtype))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = packed.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> QuantLinear:
        return cls(quantize(weight, qtype), qtype, weight.shape[1], bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (for inspection and tests; the forward never builds it whole
        below DENSE_FROM_ROWS rows)."""
        return _dequantize_split(self.packed, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"quantised linear layers take float32 activations, got {x.dtype}")
        rows = x.numel() // self.in_features
        if rows >= DENSE_FROM_ROWS:
            y = F.linear(x, self.weight)
        else:
            y = _ops().qmatmul(x, self.packed, self.qtype)
        return y if self.bias is None else y + self.bias

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The lm_head of a fused decode step: fewer than 4 rows take the int16-activation
        matvec the fused layers use (their numerics), else the exact path."""
        rows = x.numel() // self.in_features
        if rows >= 4 or x.dtype != torch.float32:
            return self(x)
        y = _ops().qmatmul(x, self.packed, self.qtype, True)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {weight_type(self.qtype).name}"


class QuantEmbedding(nn.Module):
    """Rows of a packed [vocab, hidden] table, dequantised on lookup. Shares its buffer with a
    tied QuantLinear lm_head, so a tied table is resident once."""

    def __init__(self, packed: torch.Tensor, qtype: int, embedding_dim: int) -> None:
        """`packed`: GGUF blocks, kept split (split_rows)."""
        super().__init__()
        self.register_buffer("packed", split_rows(packed, qtype))
        self.qtype = qtype
        self.embedding_dim = embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return _dequantize_split(self.packed, self.qtype, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = _dequantize_split(self.packed, self.qtype, self.embedding_dim, ids.reshape(-1))
        return flat.view(*ids.shape, self.embedding_dim)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (tied tables share one)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
