"""A request body that stalls is answered 408 by the connection guard (--body-timeout), which
then closes the connection. The handler still reading that body (AICI REST's /v1/run and
upload, GraphPipe's POST) sees the connection lost: it ends the request quietly, without
aiohttp's "Error handling request" traceback at ERROR, one per stalled request, which a hostile
client could repeat to flood the log. Raw sockets, as in test_connection_deadlines.py."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.reliability.conftest import Servers

BODY_TIMEOUT_S = 1.0
# a head that promises 100 bytes of body, then a few of them and nothing more
STALLED = b'POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: 100\r\n\r\n{"controller": '
STALLED_CHUNKED = (
    b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'f\r\n{"controller": \r\n'
)
# the port, the path whose handler reads the body, its content type
ROUTES = {
    "aici run": ("aici", b"/v1/run", b"application/json"),
    "aici upload": ("aici", b"/v1/controllers", b"application/wasm"),
    "graphpipe": ("graphpipe", b"/", b"application/octet-stream"),
}


@pytest.fixture(scope="module")
def servers(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from tokenwire.protocols import connection_guard

    policy_before = connection_guard.current_policy()
    store = tmp_path_factory.mktemp("aici-store")
    servers = Servers(
        engine, "--body-timeout", str(BODY_TIMEOUT_S), "--aici-store-dir", str(store), aici=True
    )
    yield servers
    servers.stop()
    connection_guard.configure(policy_before)  # servers started later by other tests: as they were


def _stall(port: int, head: bytes) -> bytes:
    """Send `head` and a part of the body, then nothing: what the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_S + 5) as sock:
        sock.sendall(head)
        chunks = []
        try:
            while data := sock.recv(65536):
                chunks.append(data)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def _handler_done(caplog: pytest.LogCaptureFixture, protocol: str, since: int) -> bool:
    """The handler's access line (written when it ends, whatever the outcome) is there."""
    return any(
        r.name == "tokenwire.access" and f"protocol={protocol}" in r.getMessage()
        for r in caplog.records[since:]
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_stalled_body_ends_the_request_without_an_error_traceback(
    servers: Servers, caplog: pytest.LogCaptureFixture, route: str, chunked: bool
) -> None:
    name, path, ctype = ROUTES[route]
    caplog.set_level(logging.INFO)
    since = len(caplog.records)
    answer = _stall(servers.ports[name], (STALLED_CHUNKED if chunked else STALLED) % (path, ctype))
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:200]
    deadline = time.monotonic() + 5
    while not _handler_done(caplog, name, since):  # the handler ends after the guard closed
        assert time.monotonic() < deadline, "the handler never ended"
        time.sleep(0.05)
    time.sleep(0.2)  # aiohttp logs a handler's exception right after the handler returns
    records = caplog.records[since:]
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert not errors, [(r.name, r.getMessage(), r.exc_text) for r in errors]
    assert not any(r.exc_info for r in records), [r.getMessage() for r in records if r.exc_info]
    # the guard's one warning names the flag; nothing else above INFO comes from the request
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1 and all("--body-timeout" in w for w in warnings), warnings


def test_a_grpc_write_to_a_client_that_left_is_not_an_error(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc.aio's ERROR + traceback for a streamed response written as its client left (the
    hostile soak's dropped Salience streams) becomes one debug line of ours; its other errors
    stay errors. The record is the one grpc's server core logs, by its logger and message."""
    core = logging.getLogger("grpc._cython.cygrpc")
    caplog.set_level(logging.DEBUG, logger="tokenwire.grpc")
    try:
        raise RuntimeError('Failed "execute_batch"')  # grpc's ExecuteBatchError, by its message
    except RuntimeError:
        core.exception(
            "ExecuteBatchError raised in core by servicer method [%s]", "/salience.v1.Salience/Generate"
        )
        core.exception("Unexpected [%s] raised by servicer method [%s]", "ValueError", "/x")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["Unexpected [ValueError] raised by servicer method [/x]"], errors
    assert any(
        r.name == "tokenwire.grpc"
        and "client that had left" in r.getMessage()
        and "Generate" in r.getMessage()
        for r in caplog.records
    )
