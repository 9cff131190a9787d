"""Deadlines on half-open HTTP requests and a cap on connections per client address, for every
HTTP and WebSocket listener of `tokenwire serve` (GraphPipe, AICI REST, LMTP, /metrics on
aiohttp; the OpenAI API on uvicorn).

Neither server bounds a request that never finishes arriving: aiohttp 3.14's only timer is
keep-alive, between requests; uvicorn 0.54's `timeout_keep_alive` likewise (issue 29 measured
150 half-open requests per port still open after 228 s). Both accept connections through
`loop.create_server(protocol_factory, sock=...)`, so one asyncio protocol wrapped around
theirs serves both: `GuardedConnection` sees every byte before the server does (decrypted,
under TLS), follows the request framing (http_framing.py) and

- closes a connection whose request head is not complete `header_timeout_s` after its first
  byte (a new connection: after accept), answering 408 if part of a head arrived and closing
  silently if nothing did;
- answers 408 and closes when a request body has sent no byte for `body_timeout_s`;
- refuses a connection from an address that already has `max_connections_per_client` open on
  this listener, with 429 naming the flag.

Deadlines count only while the server is reading: a server that paused reading (its buffers
full, a pipelined request waiting) is not the client's stall. Requests being answered and idle
keep-alive or WebSocket connections are left to the servers' own timers. The flags are the
process's (`configure`, called by limits.bind): every listener of one `serve` shares them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenwire.protocols.http_framing import Phase, RequestFramer

log = logging.getLogger("tokenwire.connections")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
LOG_INTERVAL_S = 60.0  # one line per address and kind of event per interval
CLOSE_LINGER_S = 2.0  # after our last answer, how long a client that does not read keeps its socket


@dataclass(frozen=True)
class ConnectionPolicy:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT


_policy = ConnectionPolicy()


def configure(policy: ConnectionPolicy) -> None:
    """The policy of listeners started from now on (limits.bind, from the serve flags)."""
    global _policy
    _policy = policy


def current_policy() -> ConnectionPolicy:
    return _policy


class _RateLimitedLog:
    """One warning per (event, address) per LOG_INTERVAL_S, counting the ones left out: 150
    stalled sockets from one client make one line, not 150."""

    MAX_KEYS = 4096  # beyond it, keys older than the interval are dropped

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, event: str, address: str, message: str) -> None:
        now = time.monotonic()
        key = (event, address)
        last, left_out = self._last.get(key, (float("-inf"), 0))
        if now - last < LOG_INTERVAL_S:
            self._last[key] = (last, left_out + 1)
            return
        if len(self._last) >= self.MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < LOG_INTERVAL_S}
        self._last[key] = (now, 0)
        more = f" ({left_out} more since the last line)" if left_out else ""
        log.warning("%s%s", message, more)


class ListenerGuard:
    """The guard of one listening socket: its policy, its open connections per address."""

    def __init__(self, name: str, policy: ConnectionPolicy | None = None) -> None:
        self.name = name  # for the log: which listener
        self.policy = policy or current_policy()
        self.open_per_address: dict[str, int] = {}
        self.log = _RateLimitedLog()

    def wrap(self, make_protocol: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for loop.create_server: the server's own, guarded."""
        return lambda: GuardedConnection(self, make_protocol)

    def admit(self, address: str) -> bool:
        count = self.open_per_address.get(address, 0)
        if count >= self.policy.max_connections_per_client:
            return False
        self.open_per_address[address] = count + 1
        return True

    def release(self, address: str) -> None:
        count = self.open_per_address.get(address, 0) - 1
        if count > 0:
            self.open_per_address[address] = count
        else:
            self.open_per_address.pop(address, None)


def _http_response(status: str, text: str, *headers: str) -> bytes:
    body = text.encode()
    head = [f"HTTP/1.1 {status}", "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(body)}"]
    head += [*headers, "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _WatchedTransport(asyncio.Transport):
    """The transport the server is given: the real one, noting each write, so that a deadline
    never appends a 408 to an answer the server already began (aiohttp answers 404 to an unknown
    path before reading the body, then waits for the body)."""

    def __init__(self, connection: GuardedConnection, real: asyncio.Transport) -> None:
        super().__init__()
        self._connection = connection
        self._real = real

    def write(self, data: bytes | bytearray | memoryview) -> None:
        # "HTTP/1.1 100 Continue" is no answer: the client sends its body after it
        if bytes(data[:10]) != b"HTTP/1.1 1":
            self._connection.answered = True
        self._real.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._connection.answered = True
        self._real.writelines(list_of_data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def close(self) -> None:
        self._real.close()

    def abort(self) -> None:
        self._real.abort()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def pause_reading(self) -> None:
        self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def write_eof(self) -> None:
        self._real.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """The server switched protocols (a WebSocket upgrade in uvicorn): no longer HTTP."""
        assert isinstance(protocol, asyncio.Protocol)
        self._connection.switch_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._connection.inner or self._connection


class GuardedConnection(asyncio.Protocol):
    """One accepted connection: the server's protocol inside, the deadlines and the cap outside."""

    def __init__(self, guard: ListenerGuard, make_protocol: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self._make_protocol = make_protocol
        self.inner: asyncio.Protocol | None = None  # None: refused (over the cap) or not yet made
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.framer = RequestFramer()
        self._loop = asyncio.get_running_loop()
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._last_byte = 0.0
        self._fresh = True  # no byte yet on this connection
        self.answered = False  # the server wrote since the current request began

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.guard.admit(self.address):
            self._refuse()
            return
        self.inner = self._make_protocol()
        self.inner.connection_made(_WatchedTransport(self, transport))
        self._start_head_deadline()

    def data_received(self, data: bytes) -> None:
        inner = self.inner
        if inner is None:
            return  # refused: read and dropped until the client closes (see _refuse)
        framer = self.framer
        if framer.phase is Phase.UPGRADED:
            inner.data_received(data)
            return
        self._fresh = False
        self._last_byte = self._loop.time()
        started = framer.requests_started
        framer.feed(data)
        if framer.requests_started != started:
            self.answered = False
        phase = framer.phase
        if phase is Phase.HEAD_TOO_LARGE:
            if self.transport is None or self.transport.is_closing():
                return  # answered already
            self._answer_and_close(
                _http_response("431 Request Header Fields Too Large", "request head over 64 KiB\n")
            )
            return
        if phase is Phase.HEAD:
            if self._head_timer is None:
                self._start_head_deadline()
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if phase is Phase.BODY and self._body_timer is None:
            self._body_timer = self._loop.call_later(self.guard.policy.body_timeout_s, self._body_expired)
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.inner is None:
            return False  # refused: the client read its answer and closed; close too
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        if self.inner is not None:
            self.guard.release(self.address)
            self.inner.connection_lost(exc)
            self.inner = None

    def switch_protocol(self, protocol: asyncio.Protocol) -> None:
        self.inner = protocol
        self.framer.phase = Phase.UPGRADED
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ------------------------------------------------------------------ deadlines
    def _server_paused_reading(self) -> bool:
        return self.transport is not None and not self.transport.is_reading()

    def _start_head_deadline(self) -> None:
        self._head_timer = self._loop.call_later(self.guard.policy.header_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self.framer.phase is not Phase.HEAD and not self._fresh:
            return  # the head arrived in the meantime (data_received cancels; belt and braces)
        if self._server_paused_reading():
            self._start_head_deadline()
            return
        timeout = self.guard.policy.header_timeout_s
        self.guard.log.warn(
            "head",
            self.address,
            f"{self.guard.name}: closed a connection from {self.address} whose request head was not "
            f"complete within {timeout:g}s (--header-timeout)",
        )
        if self._fresh or self.answered:  # nothing was said, or the server answered already
            self._close()
        else:
            self._answer_and_close(
                _http_response(
                    "408 Request Timeout",
                    f"request head not complete within {timeout:g}s (--header-timeout)\n",
                )
            )

    def _body_expired(self) -> None:
        self._body_timer = None
        if self.framer.phase is not Phase.BODY or self.transport is None or self.transport.is_closing():
            return
        timeout = self.guard.policy.body_timeout_s
        idle = self._loop.time() - self._last_byte
        if self._server_paused_reading() or idle < timeout:
            wait = timeout if self._server_paused_reading() else timeout - idle
            self._body_timer = self._loop.call_later(wait, self._body_expired)
            return
        self.guard.log.warn(
            "body",
            self.address,
            f"{self.guard.name}: closed a connection from {self.address} whose request body sent "
            f"nothing for {timeout:g}s (--body-timeout)",
        )
        if self.answered:
            self._close()
            return
        self._answer_and_close(
            _http_response("408 Request Timeout", f"request body stalled for {timeout:g}s (--body-timeout)\n")
        )

    # ------------------------------------------------------------------ closing
    def _refuse(self) -> None:
        """Over the cap: 429 at once, before the request is read. Then half-close and drop what
        the client sends until it closes (closing with its request unread would make the kernel
        send RST, and a client may lose the answer to it), at most CLOSE_LINGER_S."""
        cap = self.guard.policy.max_connections_per_client
        self.guard.log.warn(
            "cap",
            self.address,
            f"{self.guard.name}: refused a connection from {self.address}: {cap} already open "
            f"(--max-connections-per-client)",
        )
        text = f"too many connections from {self.address}: {cap} open (--max-connections-per-client {cap})\n"
        assert self.transport is not None
        self.transport.write(_http_response("429 Too Many Requests", text, "Retry-After: 1"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()
        self._linger_timer = self._loop.call_later(CLOSE_LINGER_S, self._abort)

    def _answer_and_close(self, response: bytes) -> None:
        assert self.transport is not None
        self.transport.write(response)
        self._close()

    def _close(self) -> None:
        """Close (the answer is flushed first); a client that reads nothing cannot keep the
        socket past CLOSE_LINGER_S."""
        assert self.transport is not None
        self.transport.close()
        self._linger_timer = self._loop.call_later(CLOSE_LINGER_S, self._abort)

    def _abort(self) -> None:
        self._linger_timer = None
        if self.transport is not None:
            self.transport.abort()
