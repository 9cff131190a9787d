"""Where an HTTP/1.x connection stands, read from the bytes a client sends: between requests, in a
request's head, in its body, or upgraded (a WebSocket, no longer HTTP).

connection_guard.py times the head and the body with this; the servers behind it (aiohttp,
uvicorn) still parse every byte themselves. So this reads only what framing needs (the end of
the head, Content-Length, chunked framing, Upgrade) and never rejects anything: a malformed
request is the server's to answer (400, then it closes the connection).
"""

from __future__ import annotations

import enum

# Following a 130-byte POST head and its 120-byte body costs ~8 us (timeit), against milliseconds
# to serve it. A head past MAX_HEAD_BYTES is answered 431 by the guard: aiohttp refuses a line
# over 8190 bytes and h11 a head over 16 KiB, but uvicorn's httptools parser has no cap of its own.
MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE = 64  # enough for any chunk size in hex; extensions past it are skipped unread


class Phase(enum.Enum):
    BETWEEN = "between requests"  # the last request arrived whole (or none yet)
    HEAD = "request head"  # request line and headers, up to the empty line
    BODY = "request body"
    HEAD_TOO_LARGE = "request head too large"
    MAYBE_UPGRADED = "after an upgrade request"  # a WebSocket if the server said 101
    UPGRADED = "upgraded"  # WebSocket frames: the guard stops reading along


class _Chunk(enum.Enum):
    SIZE = 1  # the chunk-size line
    DATA = 2
    DATA_END = 3  # the CRLF after a chunk's data
    TRAILERS = 4  # after the last (0) chunk: trailer lines up to an empty one


class RequestFramer:
    """Fed every byte a client sends, in order; `phase` says what those bytes were part of."""

    def __init__(self) -> None:
        self.phase = Phase.BETWEEN
        self.requests_started = 0
        self._head = bytearray()
        self._body_left = 0  # Content-Length bytes still to come
        self._chunked = False
        self._chunk = _Chunk.SIZE
        self._line = bytearray()  # the start of a chunk-size or trailer line
        self._line_len = 0
        self._upgrade = False  # the request in progress asked for an upgrade
        self._pending = b""  # after an upgrade request: the first byte, until the second decides

    @property
    def head_bytes(self) -> int:
        return len(self._head)

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            phase = self.phase
            if phase is Phase.BETWEEN:
                self.phase = Phase.HEAD
                self.requests_started += 1
                self._head.clear()
            elif phase is Phase.HEAD:
                pos = self._feed_head(data, pos)
            elif phase is Phase.BODY:
                pos = self._feed_chunked(data, pos) if self._chunked else self._feed_length(data, pos)
            elif phase is Phase.MAYBE_UPGRADED:
                pos = self._feed_after_upgrade(data, pos)
            else:  # UPGRADED, HEAD_TOO_LARGE: nothing more to follow
                return

    def _feed_head(self, data: bytes, pos: int) -> int:
        start = max(0, len(self._head) - 2)  # the empty line may straddle two reads
        self._head += data[pos:]
        crlf, lf = self._head.find(b"\n\r\n", start), self._head.find(b"\n\n", start)
        ends = [(i + 3) for i in (crlf,) if i >= 0] + [(i + 2) for i in (lf,) if i >= 0]
        if not ends:
            if len(self._head) > MAX_HEAD_BYTES:
                self.phase = Phase.HEAD_TOO_LARGE
            return len(data)
        head_end = min(ends)
        rest = len(self._head) - head_end  # bytes of this read past the head
        self._start_body(bytes(self._head[:head_end]))
        self._head.clear()
        return len(data) - rest

    def _start_body(self, head: bytes) -> None:
        length, chunked, upgrade, connection = 0, False, False, b""
        for line in head.split(b"\n")[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif name == b"upgrade":
                upgrade = True
            elif name == b"connection":
                connection = value.lower()
        self._upgrade = upgrade and b"upgrade" in connection
        self._chunked = chunked  # chunked wins over a Content-Length (RFC 9112 6.3)
        self._chunk, self._line_len = _Chunk.SIZE, 0
        self._line.clear()
        self._body_left = 0 if chunked else length
        if chunked or length > 0:
            self.phase = Phase.BODY
        else:
            self._end_request()

    def _end_request(self) -> None:
        self.phase = Phase.MAYBE_UPGRADED if self._upgrade else Phase.BETWEEN
        self._pending = b""

    def _feed_length(self, data: bytes, pos: int) -> int:
        take = min(self._body_left, len(data) - pos)
        self._body_left -= take
        if self._body_left == 0:
            self._end_request()
        return pos + take

    def _feed_chunked(self, data: bytes, pos: int) -> int:
        if self._chunk is _Chunk.DATA:
            take = min(self._body_left, len(data) - pos)
            self._body_left -= take
            if self._body_left == 0:
                self._chunk = _Chunk.DATA_END
            return pos + take
        newline = data.find(b"\n", pos)
        stop = newline if newline >= 0 else len(data)
        room = _MAX_CHUNK_LINE - len(self._line)
        if room > 0:
            self._line += data[pos : min(stop, pos + room)]
        self._line_len += stop - pos
        if newline < 0:
            return len(data)
        line = bytes(self._line).rstrip(b"\r")
        line_len = self._line_len - (1 if self._line.endswith(b"\r") else 0)
        self._line.clear()
        self._line_len = 0
        if self._chunk is _Chunk.SIZE:
            size = line.split(b";", 1)[0].strip()
            try:
                self._body_left = int(size, 16)
            except ValueError:  # malformed: the server answers 400 and closes
                self._end_request()
                return newline + 1
            self._chunk = _Chunk.DATA if self._body_left > 0 else _Chunk.TRAILERS
        elif self._chunk is _Chunk.DATA_END:
            self._chunk = _Chunk.SIZE
        elif line_len == 0:  # TRAILERS: the empty line ends the body
            self._end_request()
        return newline + 1

    def _feed_after_upgrade(self, data: bytes, pos: int) -> int:
        """A WebSocket client masks every frame, so a frame's second byte has its high bit set;
        a request line's second byte is ASCII. The first byte alone cannot tell (with
        permessage-deflate a frame may start with 'A')."""
        second = pos + (0 if self._pending else 1)
        if second >= len(data):
            self._pending = data[pos : pos + 1]
            return len(data)
        if data[second] & 0x80:
            self.phase = Phase.UPGRADED
            return len(data)
        # another HTTP request: the server refused the upgrade; its head starts at the first byte
        self.phase = Phase.HEAD
        self.requests_started += 1
        self._head[:] = self._pending
        self._pending = b""
        return pos
