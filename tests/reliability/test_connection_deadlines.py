"""Half-open HTTP requests end at their deadline and one address cannot hold every socket
(issue 29, finding 3; docs/limits.md "Per connection"): on every HTTP and WebSocket port of
`tokenwire serve`, the aiohttp ones (GraphPipe, LMTP, /metrics, AICI REST) and uvicorn's
(the OpenAI API). Raw sockets, so what a client reads back is exactly what the server sent."""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.reliability.conftest import MODEL, Servers, free_ports, serve_args

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
CAP = 4
# How long a test waits for what must happen before it says it never did: a hang guard, 10x
# the deadlines (what the server answers at once takes milliseconds). No test asserts an upper
# bound on time; a deadline's answer is asserted not to come before the deadline.
HANG_GUARD_S = 10 * max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S)
# exactly the finding's request: the head never ends
HALF_OPEN = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
# a request each port serves, and what its status line says
NORMAL_REQUEST = {
    "http": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
    "graphpipe": (b"GET /control/is_alive HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
    "lmtp": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 426"),  # served: "connect with a WebSocket"
    "metrics": (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
    "aici": (b"GET /v1/controllers/tags HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
}


@pytest.fixture(scope="module")
def servers(engine: Any) -> Iterator[Servers]:
    from tokenwire.metrics import bind_metrics
    from tokenwire.protocols import connection_guard

    policy_before = connection_guard.current_policy()
    servers = Servers(
        engine,
        "--header-timeout", str(HEADER_TIMEOUT_S),
        "--body-timeout", str(BODY_TIMEOUT_S),
        "--max-connections-per-client", str(CAP),
    )  # fmt: skip
    (metrics_port,) = free_ports(1)
    metrics = bind_metrics("127.0.0.1", metrics_port)
    assert metrics is not None
    stop_metrics = servers.call(metrics.start(engine))
    servers.ports["metrics"] = metrics_port
    yield servers
    servers.call(stop_metrics())
    servers.stop()
    connection_guard.configure(policy_before)  # servers started later by other tests: as they were


def test_the_flags_must_be_positive() -> None:
    from tokenwire.protocols import limits

    for flag in ("--header-timeout", "--body-timeout", "--max-connections-per-client"):
        with pytest.raises(ValueError, match=f"{flag} must be positive"):
            asyncio.run(limits.bind(serve_args(flag, "0")))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)


def read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (seconds from now, for
    lower bounds only); AssertionError if it is still open after `within_s` (a hang guard)."""
    start = time.monotonic()
    sock.settimeout(within_s)
    chunks = []
    try:
        while data := sock.recv(65536):
            chunks.append(data)
    except TimeoutError:
        raise AssertionError(f"still open after {within_s}s; read {b''.join(chunks)[:200]!r}") from None
    except ConnectionResetError:
        pass
    return b"".join(chunks), time.monotonic() - start


def response_status(sock: socket.socket) -> int:
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def assert_serves(port: int, name: str) -> None:
    request, status = NORMAL_REQUEST[name]
    with connect(port) as sock:
        sock.sendall(request)
        head = sock.recv(4096)
    assert head.startswith(status), (name, head[:200])


@pytest.mark.parametrize("name", ["http", "graphpipe", "lmtp", "metrics"])
def test_half_open_request_gets_408_and_is_closed(servers: Servers, name: str) -> None:
    port = servers.ports[name]
    with connect(port) as sock:
        sock.sendall(HALF_OPEN)
        answer, took = read_until_closed(sock, HANG_GUARD_S)
    assert answer.startswith(b"HTTP/1.1 408"), (name, answer[:200])
    assert b"--header-timeout" in answer
    assert HEADER_TIMEOUT_S * 0.8 <= took, took
    assert_serves(port, name)


@pytest.mark.parametrize("name", ["http", "graphpipe"])
def test_silent_connection_is_closed_without_an_answer(servers: Servers, name: str) -> None:
    with connect(servers.ports[name]) as sock:
        answer, took = read_until_closed(sock, HANG_GUARD_S)
    assert answer == b"" and took >= HEADER_TIMEOUT_S * 0.8, (answer, took)


@pytest.mark.parametrize("name", ["http", "graphpipe"])
def test_trickled_head_is_cut_at_the_total_deadline(servers: Servers, name: str) -> None:
    """A byte every 0.2 s keeps arriving, yet the head's deadline is total, not idle: the 408
    comes while the head is still coming (an idle deadline, never idle 1 s here, would let the
    whole trickle through and answer nothing), and not before the deadline."""
    pause = 0.2
    trickle = (HALF_OPEN * 10)[: int(HANG_GUARD_S / pause)]  # at least HANG_GUARD_S of trickling
    sent = 0
    with connect(servers.ports[name]) as sock:
        sock.settimeout(pause)
        start = time.monotonic()
        answer = b""
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
                sent += 1
                answer = sock.recv(4096)
                break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), f"no 408 after {sent}/{len(trickle)} bytes: {answer[:200]!r}"
    assert sent < len(trickle), sent  # cut mid-head
    assert took >= HEADER_TIMEOUT_S * 0.8, took


def stalled_body(path: bytes, chunked: bool) -> bytes:
    head = HALF_OPEN.replace(b"/v1/completions", path)
    if chunked:
        return head + b'Transfer-Encoding: chunked\r\n\r\n9\r\n{"model":\r\n3\r\n "x'
    return head + b'Content-Length: 100\r\n\r\n{"model": '


BODY_PATH = {"http": b"/v1/completions", "graphpipe": b"/"}  # routes that read the body


@pytest.mark.parametrize("name", ["http", "graphpipe"])
@pytest.mark.parametrize("chunked", [False, True])
def test_stalled_body_gets_408_and_is_closed(servers: Servers, name: str, chunked: bool) -> None:
    with connect(servers.ports[name]) as sock:
        sock.sendall(stalled_body(BODY_PATH[name], chunked))
        answer, took = read_until_closed(sock, HANG_GUARD_S)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-timeout" in answer and took >= BODY_TIMEOUT_S * 0.8
    assert_serves(servers.ports[name], name)


@pytest.mark.parametrize("name", ["http", "graphpipe"])
def test_stalled_body_after_100_continue_gets_408(servers: Servers, name: str) -> None:
    """The server's interim "100 Continue" invites the body; it is not an answer to the request."""
    start = stalled_body(BODY_PATH[name], chunked=False).replace(
        b"Content-Length", b"Expect: 100-continue\r\nContent-Length"
    )
    with connect(servers.ports[name]) as sock:
        sock.sendall(start)
        answer, _ = read_until_closed(sock, HANG_GUARD_S)
    assert answer.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 408" in answer, answer[:300]


def test_head_over_64_kib_gets_431(servers: Servers) -> None:
    """uvicorn's httptools parser would buffer a head of any size; the guard stops at 64 KiB."""
    with connect(servers.ports["http"]) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 70_000)
        answer, _ = read_until_closed(sock, HANG_GUARD_S)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_stalled_body_after_the_server_answered_is_closed_without_a_408(servers: Servers) -> None:
    """aiohttp answers an unknown path (404) before reading the body, then waits for the body;
    the deadline closes the connection but appends nothing to that answer."""
    with connect(servers.ports["graphpipe"]) as sock:
        sock.sendall(stalled_body(b"/no/such/path", chunked=False))
        answer, _ = read_until_closed(sock, HANG_GUARD_S)
    assert answer.startswith(b"HTTP/1.1 404") and b"408" not in answer, answer


def test_slow_body_that_keeps_coming_is_served(servers: Servers) -> None:
    """The body deadline is idle time: a byte every 0.4 s for ~2 s (twice the deadline) is a
    slow client, not a stalled one. And after the answer, a kept-alive connection idle longer
    than the head deadline still takes its next request (between requests: keep-alive's)."""
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with connect(servers.ports["http"]) as sock:
        sock.sendall(head + body[:-5])
        for byte in body[-5:]:
            time.sleep(0.4)
            sock.sendall(bytes([byte]))
        assert response_status(sock) == 200
        time.sleep(HEADER_TIMEOUT_S * 1.5)
        sock.sendall(NORMAL_REQUEST["http"][0])
        assert response_status(sock) == 200


def test_websocket_outlives_the_http_deadlines(servers: Servers) -> None:
    """An upgraded LMTP connection is WebSocket frames, not a request: idle past both deadlines,
    it still generates (its own --idle-timeout, 300 s here, governs it)."""
    from tokenwire.lmtp import Client

    async def generate_after_idle() -> str:
        async with await Client.connect(servers.url("lmtp"), extensions=["text"]) as client:
            await asyncio.sleep(HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 0.5)
            return await client.complete("Hello", max_tokens=2)

    assert isinstance(asyncio.run(asyncio.wait_for(generate_after_idle(), 30)), str)


@pytest.mark.parametrize("name", ["http", "graphpipe"])
def test_connections_per_client_are_capped(
    servers: Servers, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = servers.ports[name]
    request = NORMAL_REQUEST[name][0].decode().split()[1]

    def open_kept_alive() -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
        conn.request("GET", request)
        response = conn.getresponse()
        response.read()
        assert response.status == 200, response.status
        return conn

    caplog.set_level(logging.WARNING, "tokenwire.connections")
    held = [open_kept_alive() for _ in range(CAP)]
    try:
        for _ in range(3):  # over the cap: 429 naming the flag, however many times
            with connect(port) as sock:
                sock.sendall(NORMAL_REQUEST[name][0])
                answer, _ = read_until_closed(sock, HANG_GUARD_S)
            assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
            assert b"--max-connections-per-client 4" in answer
        refusals = [r for r in caplog.records if "--max-connections-per-client" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]  # once per address per interval
        for conn in held[:2]:
            conn.close()
        held = held[2:]
        deadline = time.monotonic() + HANG_GUARD_S  # the server sees the close asynchronously
        while True:
            try:
                held += [open_kept_alive(), open_kept_alive()]
                break
            except (AssertionError, ConnectionError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        for conn in held:
            conn.close()


def test_websocket_connections_per_client_are_capped(servers: Servers) -> None:
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            held = [await session.ws_connect(servers.url("lmtp")) for _ in range(CAP)]
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(servers.url("lmtp"))
            assert refused.value.status == 429
            await held.pop().close()
            deadline = time.monotonic() + HANG_GUARD_S  # the server sees the close asynchronously
            while True:
                try:
                    held.append(await session.ws_connect(servers.url("lmtp")))
                    break
                except aiohttp.WSServerHandshakeError as exc:
                    assert exc.status == 429, exc
                    assert time.monotonic() < deadline, "the closed connection never left the count"
                    await asyncio.sleep(0.05)
            for ws in held:
                await ws.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_aici_rest_half_open_request_gets_408(engine: Any, tmp_path: Any) -> None:
    """AICI REST is one more aiohttp site (started through http_site.start_site)."""
    from tokenwire.protocols import connection_guard

    policy_before = connection_guard.current_policy()
    servers = Servers(
        engine, "--header-timeout", str(HEADER_TIMEOUT_S), "--aici-store-dir", str(tmp_path), aici=True
    )
    try:
        port = servers.ports["aici"]
        with connect(port) as sock:
            sock.sendall(HALF_OPEN)
            answer, _ = read_until_closed(sock, HANG_GUARD_S)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert_serves(port, "aici")
    finally:
        servers.stop()
        connection_guard.configure(policy_before)
