"""The request framing the connection guard times (http_framing.py): where a byte stream stands,
however it is split into reads."""

from __future__ import annotations

import pytest

from tokenwire.protocols.http_framing import MAX_HEAD_BYTES, Phase, RequestFramer

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = (
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n"
)
UPGRADE = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\r\n"
MASKED_TEXT_FRAME = bytes([0x81, 0x85, 1, 2, 3, 4]) + b"hello"


def feed_split(stream: bytes, size: int) -> RequestFramer:
    framer = RequestFramer()
    for i in range(0, len(stream), size):
        framer.feed(stream[i : i + size])
    return framer


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_whole_requests_end_between_requests_however_split(size: int) -> None:
    framer = feed_split(GET + POST + CHUNKED + GET, size)
    assert framer.phase is Phase.BETWEEN and framer.requests_started == 4


@pytest.mark.parametrize(
    ("stream", "phase"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", Phase.HEAD),
        (POST[:-1], Phase.BODY),
        (CHUNKED[:-2], Phase.BODY),  # the trailers' empty line not yet sent
        (CHUNKED.replace(b"0\r\nX-Trailer: 1\r\n\r\n", b""), Phase.BODY),  # no last chunk
        (b"GET / HTTP/1.1\nHost: x\n\n", Phase.BETWEEN),  # bare LF line ends, as lenient parsers take
        (b"X" * (MAX_HEAD_BYTES + 1), Phase.HEAD_TOO_LARGE),
    ],
)
def test_partial_requests(stream: bytes, phase: Phase) -> None:
    for size in (1, len(stream)):
        assert feed_split(stream, size).phase is phase


@pytest.mark.parametrize("size", [1, 100])
def test_upgrade_then_websocket_frames_is_upgraded(size: int) -> None:
    assert feed_split(UPGRADE + MASKED_TEXT_FRAME, size).phase is Phase.UPGRADED


@pytest.mark.parametrize("size", [1, 100])
def test_refused_upgrade_then_another_request_is_still_http(size: int) -> None:
    framer = feed_split(UPGRADE + b"POST /v1/completions HTTP/1.1\r\nHost", size)
    assert framer.phase is Phase.HEAD and framer.requests_started == 2
    framer.feed(b": x\r\n\r\n")
    assert framer.phase is Phase.BETWEEN
