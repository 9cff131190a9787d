"""Tensors on the wire: numpy views on the received buffer, and one copy into the builder.

Decoding never loops over numeric elements and never copies the payload: `data` becomes
`np.frombuffer(buf, dtype, count, offset).reshape(shape)`, a (read-only when the buffer is
bytes) view that lives as long as the buffer does. Encoding reserves the vector in the
flatbuffers builder and writes the array's bytes into it once. String tensors (one
Python object per element by nature) decode to object arrays of `bytes`.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import flatbuffers
import numpy as np

from tokenwire.protocols.graphpipe.flatreader import CodecError, Table
from tokenwire.protocols.graphpipe.types import NUMERIC_DTYPES, Type, type_name, type_of_dtype

# Tensor vtable slots, in the spec's field order
TYPE, SHAPE, DATA, STRING_VAL = 0, 1, 2, 3
# Where our encoder places a tensor's data: aligned so the decoded view is aligned for every
# dtype (flatbuffers aligns relative to the buffer end, and Finish pads the start to match).
DEFAULT_DATA_ALIGNMENT = 16


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def decode_tensor(t: Table, what: str = "tensor") -> np.ndarray:
    """Decode one Tensor table; `what` names it in error messages (e.g. "input 'x'")."""
    type_id = t.u8(TYPE)
    shape_vec = t.vector(SHAPE, 8)
    if shape_vec is None:
        shape: tuple[int, ...] = ()
    else:
        start, n = shape_vec
        if n <= 16:  # the usual ranks: one cached struct call beats numpy's per-call overhead
            shape = _shape_struct(n).unpack_from(t.buf, start)
        else:
            shape = tuple(np.frombuffer(t.buf, "<i8", n, start).tolist())
        if n and min(shape) < 0:
            raise CodecError(f"{what}: negative dimension in shape {_shape_str(shape)}")
    count = math.prod(shape)
    data_vec = t.vector(DATA, 1)
    strings_vec = t.vector(STRING_VAL, 4)
    data_len = data_vec[1] if data_vec else 0
    strings_len = strings_vec[1] if strings_vec else 0
    if data_len and strings_len:
        raise CodecError(f"{what}: both data and string_val are set (one of them must be empty)")
    if type_id == Type.String:
        if data_len:
            raise CodecError(f"{what}: String tensor carries {data_len} bytes of data instead of string_val")
        if strings_len != count:
            raise CodecError(
                f"{what}: shape {_shape_str(shape)} needs {count} strings, string_val has {strings_len}"
            )
        return _decode_strings(t, strings_vec).reshape(shape)
    dtype = _DTYPE_BY_ID.get(type_id)
    if dtype is None:
        raise CodecError(f"{what}: unsupported tensor type {type_name(type_id)}")
    if strings_len:
        raise CodecError(f"{what}: {type_name(type_id)} tensor carries string_val instead of data")
    need = count * dtype.itemsize
    if data_len != need:
        raise CodecError(
            f"{what}: shape {_shape_str(shape)} of {type_name(type_id)} needs {need} bytes of data, "
            f"got {data_len}"
        )
    if count == 0:
        return np.empty(shape, dtype)
    assert data_vec is not None
    return np.frombuffer(t.buf, dtype, count, data_vec[0]).reshape(shape)


_DTYPE_BY_ID = {int(t): dtype for t, dtype in NUMERIC_DTYPES.items()}


@lru_cache(maxsize=17)
def _shape_struct(rank: int) -> struct.Struct:
    return struct.Struct(f"<{rank}q")


def _decode_strings(t: Table, vec: tuple[int, int] | None) -> np.ndarray:
    out = np.empty(0 if vec is None else vec[1], dtype=object)
    if vec is None or vec[1] == 0:
        return out
    start, n = vec
    # element offsets, string starts and lengths computed vectorised; only the bytes objects
    # themselves are made one by one
    slots = start + 4 * np.arange(n, dtype=np.int64)
    heads = slots + np.frombuffer(t.buf, "<u4", n, start).astype(np.int64)
    if heads.max() + 4 > t.size:
        raise CodecError("string_val: a string offset points outside the buffer")
    raw = np.frombuffer(t.buf, np.uint8, t.size)
    lengths = (
        raw[heads].astype(np.int64)
        | raw[heads + 1].astype(np.int64) << 8
        | raw[heads + 2].astype(np.int64) << 16
        | raw[heads + 3].astype(np.int64) << 24
    )
    ends = heads + 4 + lengths
    if ends.max() > t.size:
        raise CodecError("string_val: a string runs past the end of the buffer")
    mv = memoryview(t.buf)
    out[:] = [bytes(mv[s:e]) for s, e in zip((heads + 4).tolist(), ends.tolist(), strict=True)]
    return out


def _as_bytes(item: object) -> bytes:
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    raise TypeError(f"String tensor element of type {type(item).__name__} is neither str nor bytes")


def encoded_size(arr: np.ndarray) -> int:
    """Upper estimate of a tensor's encoded size (to size the builder once, without regrowth)."""
    if arr.dtype.kind in "SUO":
        return 64 + 8 * arr.ndim + sum(8 + len(_as_bytes(s)) for s in arr.reshape(-1).tolist())
    return 64 + 8 * arr.ndim + arr.nbytes + DEFAULT_DATA_ALIGNMENT


def add_tensor(b: flatbuffers.Builder, arr: np.ndarray, data_alignment: int = DEFAULT_DATA_ALIGNMENT) -> int:
    """Build a Tensor table for `arr` (builder order as Oracle's client: shape, payload, table)."""
    arr = np.asarray(arr)
    wire_type = type_of_dtype(arr.dtype)
    b.StartVector(8, arr.ndim, 8)
    for dim in reversed(arr.shape):
        b.PrependInt64(dim)
    shape = b.EndVector()
    if wire_type == Type.String:
        items = [b.CreateString(_as_bytes(s)) for s in reversed(arr.reshape(-1).tolist())]
        b.StartVector(4, len(items), 4)
        for offset in items:
            b.PrependUOffsetTRelative(offset)
        payload = b.EndVector()
    else:
        flat = np.ascontiguousarray(arr, dtype=NUMERIC_DTYPES[wire_type]).reshape(-1).view(np.uint8)
        n = flat.size
        b.StartVector(1, n, data_alignment)
        b.head = b.head - n
        memoryview(b.Bytes)[b.head : b.head + n] = flat  # the payload's one copy
        payload = b.EndVector()
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(SHAPE, shape, 0)
    b.PrependUint8Slot(TYPE, int(wire_type), 0)
    b.PrependUOffsetTRelativeSlot(STRING_VAL if wire_type == Type.String else DATA, payload, 0)
    return b.EndObject()


def add_tensor_vector(b: flatbuffers.Builder, arrays: list[np.ndarray], data_alignment: int) -> int:
    # built last-first, then prepended, so the vector keeps the list's order
    tables = [add_tensor(b, a, data_alignment) for a in reversed(arrays)]
    b.StartVector(4, len(tables), 4)
    for offset in tables:
        b.PrependUOffsetTRelative(offset)
    return b.EndVector()


def add_string_vector(b: flatbuffers.Builder, strings: list[str] | list[bytes]) -> int:
    offsets = [b.CreateString(s) for s in reversed(strings)]
    b.StartVector(4, len(offsets), 4)
    for offset in offsets:
        b.PrependUOffsetTRelative(offset)
    return b.EndVector()


def new_builder(size: int) -> flatbuffers.Builder:
    """A builder over uninitialised memory: bytearray(size) would zero every byte first, a
    whole extra pass over a large payload. Safe because flatbuffers writes every byte it puts
    in the message (padding explicitly), and so does add_tensor for the payload."""
    b = flatbuffers.Builder(0)
    b.Bytes = memoryview(np.empty(max(size, 64), np.uint8))
    b.head = len(b.Bytes)
    return b


def finish(b: flatbuffers.Builder, root: int) -> memoryview:
    """The finished buffer as a view on the builder's bytes (no final copy)."""
    b.Finish(root)
    return memoryview(b.Bytes)[b.Head() :]
