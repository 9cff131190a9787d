"""A bounds-checked reader of flatbuffers tables over a bytes-like buffer.

The generated Python code trusts its input (a hostile offset can index anywhere or wrap around
with a negative offset); a server must not, so every offset is checked against the buffer
before it is followed, and a bad one raises CodecError. Vectors come back as (start, length)
so callers can take numpy views of them without copying.
"""

from __future__ import annotations

import struct

_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U8 = struct.Struct("<B").unpack_from
_I64 = struct.Struct("<q").unpack_from


class CodecError(ValueError):
    """The bytes are not a valid GraphPipe flatbuffer, or a tensor in it is inconsistent."""


class Table:
    __slots__ = ("buf", "pos", "size", "vtable", "vtable_len")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int, size: int | None = None) -> None:
        self.buf = buf
        self.size = len(buf) if size is None else size
        self.pos = pos
        self._need(pos, 4)
        vtable = pos - _I32(buf, pos)[0]
        self._need(vtable, 4)
        self.vtable = vtable
        self.vtable_len = _U16(buf, vtable)[0]
        self._need(vtable, self.vtable_len)

    @classmethod
    def root(cls, buf: bytes | bytearray | memoryview) -> Table:
        if len(buf) < 8:
            raise CodecError(f"buffer of {len(buf)} bytes is too short for a flatbuffer")
        return cls(buf, _U32(buf, 0)[0])

    def _need(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CodecError(
                f"malformed flatbuffer: offset {offset} (+{length}) outside the {self.size}-byte buffer"
            )

    def field(self, slot: int) -> int:
        """Absolute offset of field `slot`, or 0 when absent."""
        entry = 4 + 2 * slot
        if entry + 2 > self.vtable_len:
            return 0
        rel = _U16(self.buf, self.vtable + entry)[0]
        return self.pos + rel if rel else 0

    def u8(self, slot: int, default: int = 0) -> int:
        off = self.field(slot)
        if not off:
            return default
        self._need(off, 1)
        return _U8(self.buf, off)[0]

    def i64(self, slot: int, default: int = 0) -> int:
        off = self.field(slot)
        if not off:
            return default
        self._need(off, 8)
        return _I64(self.buf, off)[0]

    def _indirect(self, off: int) -> int:
        self._need(off, 4)
        return off + _U32(self.buf, off)[0]

    def table(self, slot: int) -> Table | None:
        off = self.field(slot)
        return Table(self.buf, self._indirect(off), self.size) if off else None

    def vector(self, slot: int, elem_size: int) -> tuple[int, int] | None:
        """(start offset, element count) of a vector field, or None when absent."""
        off = self.field(slot)
        if not off:
            return None
        # the checks of _indirect and _need, inlined: this runs for every tensor field
        buf, size = self.buf, self.size
        if off + 4 > size:
            self._need(off, 4)
        vec = off + _U32(buf, off)[0]
        if vec + 4 > size:
            self._need(vec, 4)
        n = _U32(buf, vec)[0]
        if vec + 4 + n * elem_size > size:
            self._need(vec + 4, n * elem_size)
        return vec + 4, n

    def string_at(self, off: int) -> bytes:
        """The string whose offset is stored at `off` (an element of a vector of strings)."""
        start = self._indirect(off)
        self._need(start, 4)
        n = _U32(self.buf, start)[0]
        self._need(start + 4, n)
        return bytes(self.buf[start + 4 : start + 4 + n])

    def string(self, slot: int) -> bytes | None:
        off = self.field(slot)
        return self.string_at(off) if off else None

    def strings(self, slot: int) -> list[bytes]:
        vec = self.vector(slot, 4)
        if vec is None:
            return []
        start, n = vec
        return [self.string_at(start + 4 * i) for i in range(n)]

    def tables(self, slot: int) -> list[Table]:
        vec = self.vector(slot, 4)
        if vec is None:
            return []
        start, n = vec
        return [Table(self.buf, self._indirect(start + 4 * i), self.size) for i in range(n)]
