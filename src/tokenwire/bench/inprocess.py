"""Every protocol server of `tokenwire serve`, started in this process through the same plugins
(bind, then start on an engine), on their own event loop in a background thread: clients reach
them over real sockets like outside ones. Used by the soak bench and the reliability tests."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any

from tokenwire import plugins
from tokenwire.server import add_serve_args


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def serve_args(*argv: str) -> argparse.Namespace:
    """`tokenwire serve`'s own parser (every plugin's flags, defaults as served)."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser, list(argv))
    return parser.parse_args(list(argv))


class InProcessServers:
    def __init__(self, engine: Any, *extra: str, aici: bool = False) -> None:
        lmtp, grpc_port, graphpipe, http, aici_port = free_ports(5)
        self.ports = {
            "lmtp": lmtp,
            "grpc": grpc_port,
            "graphpipe": graphpipe,
            "http": http,
            "aici": aici_port,
        }
        argv = [
            "--lmtp-port", str(lmtp), "--grpc-port", str(grpc_port), "--graphpipe-port", str(graphpipe),
            "--http-port", str(http), "--metrics-port", "0", *extra,
        ]  # fmt: skip
        if aici:
            argv += ["--aici", "--aici-port", str(aici_port)]
        self.args = serve_args(*argv)
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="servers", daemon=True)
        self.thread.start()
        self.stoppers = self.call(self._start(), timeout=300)

    async def _start(self) -> list[Any]:
        stoppers = []
        for plugin in plugins.SERVER_PLUGINS:
            listener = await plugin.bind(self.args)
            if listener is not None:
                stoppers.append(await listener.start(self.engine))
        return stoppers

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def url(self, name: str) -> str:
        port = self.ports[name]
        return {
            "lmtp": f"ws://127.0.0.1:{port}/",
            "grpc": f"127.0.0.1:{port}",
            "graphpipe": f"http://127.0.0.1:{port}/",
            "http": f"http://127.0.0.1:{port}/v1",
            "aici": f"http://127.0.0.1:{port}",
        }[name]

    def stop(self) -> None:
        async def stop_all() -> None:
            for stop in reversed(self.stoppers):
                await stop()

        self.call(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
