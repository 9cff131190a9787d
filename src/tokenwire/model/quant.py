"""Weights kept in GGUF's block quantisation (the types of weight_types.py), run by our CPU kernels.

A quantised weight is the GGUF's own bytes: a contiguous uint8 tensor [out_features,
in_features / block * block_bytes], one row of blocks per output feature, exactly as in the file
(q/k rows un-permuted like the fp32 path); that is what `quantize`, `dequantize` and the
conversion cache hold. In memory, QuantLinear and QuantEmbedding keep each row split
(`split_rows`: the row's scales, then its minimums, then its quants; the same bytes), the form
our kernels read: the decode matvec converts and applies eight blocks' scales at once (the
K-quants keep their 256-weight super-blocks as the file has them: a one-part layout). A tiled
type's matrix (kernels/tiles.h) is then laid out: its rows dword-interleaved by groups of 16
(AVX2: 8), the same bytes (`lay_out`), so decode reads a strip as it lies.
Nothing is re-quantised: the kernels dequantise bit-exactly as gguf's reference dequantiser
does, and a GGUF holding a type they do not run is refused at load (gguf_weights.py). A fused
projection whose parts come in different types (q/k/v of a K-quant mix) is a StackedQuantLinear,
each part in its own type. F16 and BF16 matrices are types of the table too (a block of
one value), kept as 16-bit floats. A Hugging Face directory is quantised at load with `--weights int8`
(Q8_0) or `int4` (Q4_1).
"""

from __future__ import annotations

import numpy as np
import torch
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


def _ops():
    return ops()


def packed_shape(out_features: int, in_features: int, qtype: int) -> tuple[int, int]:
    return weight_type(qtype).packed_shape(out_features, in_features)


def _quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """fp32 [..., K] -> IQ4_NL blocks, for types gguf-py cannot quantise to: per block, d maps the
    largest magnitude to the table's -127 (so its sign too), each weight takes the nearest table
    value of w/d. (llama.cpp also searches nearby scales; any valid blocks serve tests and
    from_float.)"""
    blocks = w.reshape(-1, 32).astype(np.float32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = (largest / weight_types.IQ4_VALUES[0]).astype(np.float16)
    inverse = np.divide(1, d.astype(np.float32), out=np.zeros(len(d), np.float32), where=d != 0)
    index = _nearest_iq4(blocks * inverse[:, None])
    quants = index[:, :16] | (index[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), quants], axis=1)


def _nearest_iq4(values: np.ndarray) -> np.ndarray:
    """The index of the nearest IQ4 table value of each (scaled) weight."""
    table = weight_types.IQ4_VALUES
    return np.searchsorted((table[1:] + table[:-1]) / 2, values).astype(np.uint8)


def _quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """fp32 [..., K] -> IQ4_XS super-blocks: each sub-block's own scale as IQ4_NL's, d the
    largest of them over 31, each sub-block's 6-bit ls the nearest multiple of d (clipped to
    -32..31), its weights the nearest table values of w / (d * ls)."""
    subs = w.reshape(-1, 8, 32).astype(np.float32)
    largest = np.take_along_axis(subs, np.abs(subs).argmax(axis=2)[..., None], axis=2)[..., 0]  # [n, 8]
    wanted = largest / weight_types.IQ4_VALUES[0]
    d = (np.abs(wanted).max(axis=1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    ls = np.clip(np.rint(np.divide(wanted, d32, out=np.zeros_like(wanted), where=d32 != 0)), -32, 31)
    scale = d32 * ls
    index = _nearest_iq4(subs * np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)[..., None])
    biased = (ls + 32).astype(np.uint16)  # 0..63
    low = (biased & 0x0F).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)  # [n, 4]
    scales_h = ((biased >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    quants = (index[..., :16] | (index[..., 16:] << 4)).reshape(len(d), 128)
    parts = [d.view(np.uint8).reshape(-1, 2), scales_h.view(np.uint8).reshape(-1, 2), scales_l, quants]
    return np.concatenate(parts, axis=1)


# types gguf-py has no quantiser for: ours
_OWN_QUANTIZERS = {
    weight_types.IQ4_NL.gguf_id: _quantize_iq4_nl,
    weight_types.IQ4_XS.gguf_id: _quantize_iq4_xs,
}


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 [N, K] -> packed blocks, with gguf's reference quantiser (the llama.cpp rounding)."""
    shape = packed_shape(*weight.shape, qtype)  # names a bad feature count before gguf does
    array = np.ascontiguousarray(weight.detach().float().cpu().numpy())
    if qtype in _OWN_QUANTIZERS:
        packed = _OWN_QUANTIZERS[qtype](array)
    else:
        packed = gguf_quantize(array, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(packed)).view(torch.uint8).reshape(shape)


def split_rows(packed: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks [N, nb * block_bytes] -> the kernels' row form (the type's split layout,
    laid out where the kernels read it so: `lay_out`)."""
    kind = weight_type(qtype)
    split = kind.split_rows(packed)
    if split.dim() == 2 and split.shape[1] % kind.block_bytes == 0:
        lay_out(split, qtype, split.shape[1] // kind.block_bytes * kind.block)
    return split


def lay_out(split: torch.Tensor, qtype: int, in_features: int) -> bool:
    """Split rows -> the kernels' laid-out form, in place, where they read this matrix so (a
    tiled type's matrix of whole 16- or 8-row groups: kernels/tiles.h says why); True if so.
    Every holder of split rows calls it once: the kernels tell the two forms apart by the
    matrix's shape and type alone."""
    return bool(_ops().lay_out(split, qtype, in_features))


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
        """The dequantised weight (for inspection and tests; the forward never builds it)."""
        return _dequantize_split(self.packed, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor, *, wide: bool = False) -> torch.Tensor:
        """One arithmetic for any number of rows (kernels/matvec.h, tiles.h): integer
        activations per block (int8 for the tiled types, int16 for the others) and integer block
        dots, each row summed in the same order alone or in a batch, so a token's logits do not
        depend on the batch or prefill chunk it ran in. `wide` (the lm_head): ~15-bit
        activations where the type takes int8 ones and WeightType.wide_head holds
        (quant_cpu.cpp's qmatmul_into says why).
        (fp32 activations instead when the kernels' integer activations are switched off, or the
        type has none.)"""
        if x.dtype != torch.float32:
            raise TypeError(f"quantised linear layers take float32 activations, got {x.dtype}")
        y = _ops().qmatmul(x, self.packed, self.qtype, True, wide and weight_type(self.qtype).wide_head)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {weight_type(self.qtype).name}"


class StackedQuantLinear(nn.Module):
    """A projection whose output rows come from several quantised weights of different block
    types, in order (q, k, v of a K-quant file that keeps v in more bits). The fused decode
    kernel runs each part in its own type (decode_stack.h's Proj)."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise ValueError("stacked parts share their input features and carry no bias of their own")
        self.parts = nn.ModuleList(parts)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kinds = "+".join(weight_type(p.qtype).name for p in self.parts)  # type: ignore[arg-type]
        return f"in={self.in_features}, out={self.out_features}, {kinds}"


class QuantEmbedding(nn.Module):
    """Rows of a packed [vocab, hidden] table, dequantised on lookup. Shares its buffer with a
    tied QuantLinear lm_head, so a tied table is resident once."""

    def __init__(self, packed: torch.Tensor, qtype: int, embedding_dim: int, *, split: bool = False) -> None:
        """`packed`: GGUF blocks, or with `split` rows already in split_rows' form."""
        super().__init__()
        self.register_buffer("packed", packed.contiguous() if split else split_rows(packed, qtype))
        self.qtype = qtype
        self.embedding_dim = embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return _dequantize_split(self.packed, self.qtype, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = _dequantize_split(self.packed, self.qtype, self.embedding_dim, ids.reshape(-1))
        return flat.view(*ids.shape, self.embedding_dim)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, a tensor shared by several modules counted once (a
    tied table). Tensors' own bytes, not their storages': packed weights are views into the
    weight arena's mappings (whose untouched tails are never resident)."""
    sizes: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        key = t.data_ptr()
        sizes[key] = max(sizes.get(key, 0), t.numel() * t.element_size())
    return sum(sizes.values())


def has_quantized_weights(model: nn.Module) -> bool:
    """Whether any of the model's matrices is kept in quantised blocks (QuantLinear)."""
    return any(isinstance(m, (QuantLinear, StackedQuantLinear)) for m in model.modules())
