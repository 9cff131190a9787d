"""A GGUF's tensors under Hugging Face names, read from the file one tensor at a time as the
model asks for them: no converted copy on disk, and never the whole model in memory twice.

Quantised tensors come as their GGUF blocks ([rows, row_bytes] uint8, the q/k rows un-permuted
from llama.cpp's interleaved RoPE order, as the family's float path expects); the weight loader
writes each straight into its place in the weight arena (model/layers/weights.py), so a load's
peak memory is the weights as the file holds them plus the tensor being read. Float tensors
(norms, biases, F32 matrices) come as float32.

With `dense=True` (`--weights fp32|bf16`, or int8/int4 re-quantisation) every tensor comes as
float32, dequantised exactly (the kernels' dequantiser for the types they run, gguf's reference
for the others): that fp32 copy exists only when asked for.

Reading uses plain file reads, not the reader's memory map: pages of a mapping of the file stay
resident (and counted) once touched, reads into a buffer freed after each tensor do not.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from tokenwire.model import kernels, weight_types
from tokenwire.model.config import ModelConfig
from tokenwire.model.gguf import gguf_family, gguf_meta, hf_tensor_name, unpermute_rope_rows
from tokenwire.model.gguf_header import TensorInfo, read_header
from tokenwire.model.quant import dequantize

_FLOATS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64}
# float types a tensor may also come in; kept in their type where the kernels run it as a matrix
_WIDE_FLOATS = {GGMLQuantizationType.F16, GGMLQuantizationType.BF16, *_FLOATS}
_READ_CHUNK = 1 << 30  # readinto() of more than 2 GiB at once is not portable


class UnsupportedWeightTypeError(ValueError):
    """A GGUF tensor in a block type the kernels do not run (`--weights fp32` still loads it)."""


@dataclass(frozen=True)
class GgufTensor(TensorInfo):
    """A tensor of the file (its GGUF name, type, shape, place) and what reading it undoes."""

    rope_heads: int | None = None  # q/k rows to un-permute, by this many heads
    shift: float = 0.0  # taken off the values (a norm the converter stored as 1 + w)


class GgufWeights(Mapping[str, torch.Tensor]):
    def __init__(self, path: Path, config: ModelConfig, *, dense: bool = False) -> None:
        self.path = Path(path)
        header = read_header(self.path)
        names = gguf_family(gguf_meta(header), path).gguf
        assert names is not None
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
        self.tensors: dict[str, GgufTensor] = {}
        for t in header.tensors.values():
            name = hf_tensor_name(t.name, names)
            if name is None:
                continue
            kind = t.name.split(".")[-2]
            rope = heads[kind] if names.permuted_qk and kind in heads else None
            shift = names.norm_shift if t.name.endswith("norm.weight") else 0.0
            if "{e}" not in name:
                self.tensors[name] = GgufTensor(t.name, t.qtype, t.shape, t.offset, t.nbytes, rope, shift)
                continue
            # stacked experts: each expert's rows are whole blocks, one expert after another
            experts, each = t.shape[0], t.nbytes // t.shape[0]
            for e in range(experts):
                self.tensors[name.format(e=e)] = GgufTensor(
                    f"{t.name}[{e}]", t.qtype, t.shape[1:], t.offset + e * each, each
                )
        self.qtypes: dict[str, int] = {}  # the quantised tensors' block types (none when dense)
        if not dense:
            for name, t in self.tensors.items():
                kept = int(t.qtype) in weight_types.BY_ID and len(t.shape) == 2
                if not kept and t.qtype in _WIDE_FLOATS:
                    continue  # a norm, a bias, a float matrix: float32
                if not kept:
                    known = ", ".join(w.name for w in weight_types.WEIGHT_TYPES)
                    raise UnsupportedWeightTypeError(
                        f"{self.path}: tensor {t.name} is {t.qtype.name}, a weight type tokenwire's "
                        f"kernels do not run (they run {known}); --weights fp32 loads it dequantised"
                    )
                self.qtypes[name] = int(t.qtype)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        raw = self._read(t)
        if t.qtype in _FLOATS:
            values = raw.view(_FLOATS[t.qtype]).astype(np.float32, copy=False).reshape(t.shape)
        elif name in self.qtypes:
            values = raw.reshape(t.shape[0], -1)
        else:
            values = self._dequantized(raw, t)
        if t.rope_heads is not None:
            values = unpermute_rope_rows(values, t.rope_heads)
        if t.shift:
            # exact where 1 + w lies in [0.5, 2] (Sterbenz), as trained norms' do: the layer's
            # own 1 + w then gives back the stored float bit for bit
            values = values - np.float32(t.shift)
        return torch.from_numpy(np.ascontiguousarray(values))

    def _read(self, t: GgufTensor) -> np.ndarray:
        # a mapping of its own, unmapped when the last view of it goes: from malloc, the
        # model thread's arena kept 51 MiB of freed buffers resident after an 8B's load
        # (malloc_trim did not give them back; with one arena, 9 MiB)
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        buffer = np.frombuffer(mmap.mmap(-1, max(1, t.nbytes), flags=private), dtype=np.uint8, count=t.nbytes)
        view = memoryview(buffer)
        with self.path.open("rb") as f:
            f.seek(t.offset)
            done = 0
            while done < t.nbytes:
                got = f.readinto(view[done : done + _READ_CHUNK])
                if not got:
                    raise ValueError(f"{self.path} ends inside tensor {t.name}")
                done += got
        return buffer

    def _dequantized(self, raw: np.ndarray, t: GgufTensor) -> np.ndarray:
        rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
        if int(t.qtype) in weight_types.BY_ID and kernels.loaded():
            # the kernels' dequantiser: bit-exact with gguf's, and far faster
            packed = torch.from_numpy(raw.reshape(rows, -1))
            return dequantize(packed, int(t.qtype), cols).numpy().reshape(t.shape)
        if t.qtype not in GGML_QUANT_SIZES:
            raise UnsupportedWeightTypeError(f"{self.path}: tensor {t.name} has unknown type {t.qtype}")
        return np.asarray(gguf_dequantize(raw, t.qtype), dtype=np.float32).reshape(t.shape)
