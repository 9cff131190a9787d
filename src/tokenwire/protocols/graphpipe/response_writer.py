"""A fast writer for the InferResponse of numeric tensors, the server's hot path.

The generic flatbuffers Builder costs ~30 us of Python per small response (a Prep/Place call
per scalar, a vtable search per table). An InferResponse of numeric tensors has a fixed
shape, so this writer lays it out front to back with precomputed offsets: one struct format
per (tensor count, ranks) packs every table, vtable and shape vector in one call, and each
tensor's bytes are copied once, straight from the array (strided or byte-swapped ones
included) into the message.

Layout (offsets from the start; flatbuffers only needs uoffsets to point forward, vtables may
lie anywhere, and every scalar aligned to its size):

    0          uoffset to the root table
    4          root vtable [6, 8, 4]                    (InferResponse: output_tensors only)
    12         root table  [soffset 8, uoffset -> vector]
    20         output_tensors: count, count x uoffset -> tensor tables
    24 + 4n    tensor vtable [10, 16, type@12, shape@4, data@8], shared by all tensors
    ...        tensor tables, 16 bytes each: [soffset, uoffset shape, uoffset data, type, pad]
    ...        shape vectors (int64 elements 8-aligned)
    ...        data vectors, the bytes 16-aligned (so decoded views are aligned for any dtype)
"""

from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np

from tokenwire.protocols.graphpipe.types import NUMERIC_DTYPES, Type, type_of_dtype

DATA_ALIGNMENT = 16
SMALL_MESSAGE = 1 << 20
_ROOT_VTABLE, _ROOT_TABLE, _VECTOR = 4, 12, 20
_TENSOR_VTABLE_SIZE, _TENSOR_TABLE_SIZE = 12, 16  # the vtable's 10 bytes + 2 of padding
_U32 = struct.Struct("<I")


def _align(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment


@lru_cache(maxsize=256)
def _head_layout(ranks: tuple[int, ...]) -> tuple[struct.Struct, tuple[int, ...], int]:
    """For tensors of these ranks: the struct packing everything before the data, the
    positions of the shape vectors, and the end of that head."""
    n = len(ranks)
    vtable = _VECTOR + 4 + 4 * n
    tables = vtable + _TENSOR_VTABLE_SIZE
    fmt = ["<I", "HHH2x", "iI", f"I{n}I", "HHHHH2x", "iIIB3x" * n]
    pos = tables + _TENSOR_TABLE_SIZE * n
    shapes = []
    for rank in ranks:
        start = _align(pos + 4, 8) - 4  # the length prefix, so the int64 elements are 8-aligned
        fmt.append(f"{start - pos}xI{rank}q")
        shapes.append(start)
        pos = start + 4 + 8 * rank
    return struct.Struct("".join(fmt)), tuple(shapes), pos


def encode_numeric_response(arrays: list[np.ndarray]) -> bytearray | memoryview:
    """An InferResponse holding `arrays` (numeric; the caller handles String tensors).

    Raises TypeError for a dtype GraphPipe has no type for."""
    arrays = [np.asarray(a) for a in arrays]
    types = [type_of_dtype(a.dtype) for a in arrays]
    if Type.String in types:
        raise TypeError("encode_numeric_response cannot write String tensors")
    head, shape_starts, pos = _head_layout(tuple(a.ndim for a in arrays))
    n = len(arrays)
    data_starts = []
    for a in arrays:
        start = _align(pos + 4, DATA_ALIGNMENT) - 4  # the length prefix, then aligned bytes
        data_starts.append(start)
        pos = start + 4 + a.nbytes
    size = _align(pos, 4)
    # A small message is a bytearray (aiohttp sends one as is, without a payload wrapper); a
    # large one uninitialised memory, as bytearray() would first write zeros over all of it
    buf = bytearray(size) if size <= SMALL_MESSAGE else np.empty(size, np.uint8)
    out = memoryview(buf)
    vtable = _VECTOR + 4 + 4 * n
    tables = vtable + _TENSOR_VTABLE_SIZE
    values: list[int] = [_ROOT_TABLE, 6, 8, 4, _ROOT_TABLE - _ROOT_VTABLE, _VECTOR - (_ROOT_TABLE + 4), n]
    values += [tables + 16 * i - (_VECTOR + 4 + 4 * i) for i in range(n)]
    values += [10, _TENSOR_TABLE_SIZE, 12, 4, 8]
    for i, t in enumerate(types):
        table = tables + 16 * i
        values += [table - vtable, shape_starts[i] - (table + 4), data_starts[i] - (table + 8), int(t)]
    for a in arrays:
        values.append(a.ndim)
        values += a.shape
    head.pack_into(out, 0, *values)
    end = head.size
    for a, t, start in zip(arrays, types, data_starts, strict=True):
        out[end:start] = bytes(start - end)  # padding (every byte of the message is written)
        end = start + 4 + a.nbytes
        _U32.pack_into(out, start, a.nbytes)
        body = np.frombuffer(out, NUMERIC_DTYPES[t], a.size, start + 4).reshape(a.shape)
        # the payload's one copy: row-major, little-endian, whatever the source layout
        np.copyto(body, a, casting="equiv")
    out[end:] = bytes(size - end)
    return buf if isinstance(buf, bytearray) else out
