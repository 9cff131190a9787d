"""What `tokenwire serve` asks of each protocol server, and binding ports before the model loads.

A server plugin has `add_serve_args(parser)` (its flags; a port of 0 turns it off) and
`async bind(args) -> Listener | None`: it checks its flags and takes its port at once, so a
clash is reported (one line naming the flag) before the model spends seconds loading. Once
the engine is ready, `Listener.start(engine)` serves on what was bound and returns an async
function that stops the server: stop accepting, end open streams with the protocol's own
"server shutting down" error, release everything.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

Stopper = Callable[[], Awaitable[None]]
SHUTDOWN_MESSAGE = "server shutting down"


class PortInUseError(OSError):
    """A listening address cannot be taken; the message names the flag and the address."""


class Listener(Protocol):
    async def start(self, engine: EngineAPI) -> Stopper: ...

    def close(self) -> None:
        """Start-up was abandoned (another server failed, the model did not load): release."""


def bind_tcp(host: str, port: int, flag: str) -> socket.socket:
    """A listening TCP socket on host:port (0 = any free port). Without SO_REUSEPORT, so two
    servers can never share a port; SO_REUSEADDR only lets a restart reuse it at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise PortInUseError(exc.errno, f"{flag} {port}: {reason} ({host}:{port})") from None
    sock.setblocking(False)
    return sock


class SocketListener:
    """A Listener over one bound socket; `serve(engine, sock)` starts the server on it."""

    def __init__(self, sock: socket.socket, serve: Callable[[EngineAPI, socket.socket], Awaitable[Stopper]]):
        self.sock = sock
        self._serve = serve

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def start(self, engine: EngineAPI) -> Stopper:
        return await self._serve(engine, self.sock)

    def close(self) -> None:
        self.sock.close()
