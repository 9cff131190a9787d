"""A GGUF file's header: its metadata and the place, type and shape of each tensor.

gguf-py's GGUFReader parses every item of every array through a numpy memory map, 2.0 s for
SmolLM2's 49,152-token vocabulary on this machine (a 150k-token Qwen or 262k-token Gemma file
takes several times that), paid at each start. Here the header is read into memory once and
the vocabulary's arrays are stepped over, their lengths kept: 0.05 s for the same file. The
tokenizer is built from the file by transformers, which reads those arrays itself.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_MAGIC = b"GGUF"
# GGUF value types: struct formats of the scalars (8 is a string, 9 an array)
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# arrays of the vocabulary: stepped over, only their lengths kept (`GgufHeader.lengths`)
_SKIPPED = {f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type")}
_FIRST_READ = 1 << 20  # the header is read in growing pieces: most files' fit in the first


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first (numpy order)
    offset: int  # absolute file offset of its data
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    fields: dict[str, Any]  # metadata, arrays as lists (the vocabulary's left out)
    lengths: dict[str, int]  # the vocabulary's arrays: their lengths
    tensors: dict[str, TensorInfo]
    # the vocabulary's arrays: sha256 of their bytes (a converted tokenizer is shared by every
    # file whose tokenizer is the same: model/gguf.py's tokenizer cache)
    digests: dict[str, str] = field(default_factory=dict)

    def values(self, name: str) -> np.ndarray:
        """A float tensor's values (rope factors): read from the file, as float32."""
        t = self.tensors[name]
        dtypes = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        if t.qtype not in dtypes:
            raise ValueError(f"{self.path}: tensor {name} is {t.qtype.name}, expected F32 or F16")
        with self.path.open("rb") as f:
            f.seek(t.offset)
            raw = f.read(t.nbytes)
        return np.frombuffer(raw, dtype=dtypes[t.qtype]).astype(np.float32).reshape(t.shape)


class _Cursor:
    def __init__(self, path: Path) -> None:
        self.file = path.open("rb")
        self.buffer = self.file.read(_FIRST_READ)
        self.at = 0

    def take(self, n: int) -> bytes:
        while self.at + n > len(self.buffer):
            more = self.file.read(max(n, len(self.buffer)))
            if not more:
                raise ValueError("the file ends inside its header")
            self.buffer += more
        out = self.buffer[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALARS[kind])

    def skip_array(self) -> tuple[int, str]:
        """Steps over an array: its length and the sha256 of its bytes."""
        item, count = self.unpack("<I"), self.unpack("<Q")
        start = self.at
        if item == _STRING:
            for _ in range(count):
                length = self.unpack("<Q")  # read before `at` moves on (`at += unpack()` would lose it)
                self.at += length
            self.take(0)
        else:
            self.take(count * struct.calcsize(_SCALARS[item]))
        return count, hashlib.sha256(self.buffer[start : self.at]).hexdigest()


def read_header(path: Path | str) -> GgufHeader:
    path = Path(path)
    try:
        return _read(path)
    except (ValueError, KeyError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e


def _read(path: Path) -> GgufHeader:
    cursor = _Cursor(path)
    try:
        if cursor.take(4) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (tokenwire reads 2 and 3)")
        n_tensors, n_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        fields: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        digests: dict[str, str] = {}
        for _ in range(n_fields):
            key, kind = cursor.string(), cursor.unpack("<I")
            if key in _SKIPPED and kind == _ARRAY:
                lengths[key], digests[key] = cursor.skip_array()
            else:
                fields[key] = cursor.value(kind)
        infos = []
        for _ in range(n_tensors):
            name, dims = cursor.string(), cursor.unpack("<I")
            ne = [cursor.unpack("<Q") for _ in range(dims)]
            infos.append((name, ne, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-cursor.at // alignment) * alignment
        size = path.stat().st_size
    finally:
        cursor.file.close()
    tensors = {}
    for name, ne, qtype, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(ne)) // block * block_bytes
        if start + offset + nbytes > size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors[name] = TensorInfo(name, qtype, tuple(int(d) for d in reversed(ne)), start + offset, nbytes)
    return GgufHeader(path, fields, lengths, tensors, digests)
