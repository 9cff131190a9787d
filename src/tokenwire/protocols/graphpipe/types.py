"""The GraphPipe `Type` enum (uint8 on the wire) and its mapping to little-endian numpy dtypes."""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Type(IntEnum):
    Null = 0
    Uint8 = 1
    Int8 = 2
    Uint16 = 3
    Int16 = 4
    Uint32 = 5
    Int32 = 6
    Uint64 = 7
    Int64 = 8
    Float16 = 9
    Float32 = 10
    Float64 = 11
    String = 12


# Wire data is little-endian row-major: the dtypes say so explicitly ('<'), so a big-endian
# host would still read the payload right (numpy swaps lazily on access).
NUMERIC_DTYPES: dict[Type, np.dtype] = {
    Type.Uint8: np.dtype("<u1"),
    Type.Int8: np.dtype("<i1"),
    Type.Uint16: np.dtype("<u2"),
    Type.Int16: np.dtype("<i2"),
    Type.Uint32: np.dtype("<u4"),
    Type.Int32: np.dtype("<i4"),
    Type.Uint64: np.dtype("<u8"),
    Type.Int64: np.dtype("<i8"),
    Type.Float16: np.dtype("<f2"),
    Type.Float32: np.dtype("<f4"),
    Type.Float64: np.dtype("<f8"),
}
_BY_KIND_SIZE = {(dt.kind, dt.itemsize): t for t, dt in NUMERIC_DTYPES.items()}
STRING_KINDS = frozenset("SUO")


def type_of_dtype(dtype: np.dtype) -> Type:
    """The wire Type of a numpy dtype (any byte order); String for bytes/str/object arrays."""
    if dtype.kind in STRING_KINDS:
        return Type.String
    t = _BY_KIND_SIZE.get((dtype.kind, dtype.itemsize))
    if t is None:
        raise TypeError(f"numpy dtype {dtype} has no GraphPipe type")
    return t


def type_name(t: int) -> str:
    try:
        return Type(t).name
    except ValueError:
        return f"unknown type {t}"
