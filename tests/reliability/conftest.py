"""Reliability tests: every protocol server of `tokenwire serve`, started in-process through the
same plugins `serve` uses, on the engine with the no-model backend (real scheduler, sessions
and KV blocks; RandomTokenModel skips the forward pass, so these tests are quick)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

MODEL = "SmolLM2-135M-Instruct"


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
    from tokenwire.server import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser, list(argv))
    return parser.parse_args(list(argv))


class Servers:
    """The protocol servers of `serve` (bound by their plugins, started on `engine`) running on
    their own event loop in a background thread, so clients connect like outside ones."""

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
        self.stoppers = self.call(self._start(), timeout=120)

    async def _start(self) -> list[Any]:
        from tokenwire import plugins

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


def random_engine_of(source: Any, **kw: Any) -> Any:
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    return Engine(
        lambda: RandomTokenModel(source.config),
        source.tokenizer,
        name=MODEL,
        kv_cache_mb=kw.pop("kv_cache_mb", 16),
        **kw,
    )


@pytest.fixture(scope="module")
def engine(smollm2_source: Any) -> Iterator[Any]:
    engine = random_engine_of(smollm2_source)
    yield engine
    engine.shutdown()


def idle_baseline(engine: Any) -> dict[str, Any]:
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    return stats


def wait_idle(engine: Any, baseline: dict[str, Any], timeout: float = 1.0) -> dict[str, Any]:
    """The engine's stats once nothing runs or waits, its sessions are back to `baseline`'s and
    so are its available KV blocks (AssertionError with the last stats after `timeout` s)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats["running"] == 0
            and stats["waiting"] == 0
            and stats["sessions"] <= baseline["sessions"]
            and stats["kv_blocks_available"] >= baseline["kv_blocks_available"]
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle {timeout}s later: {stats} (baseline {baseline})")
        time.sleep(0.01)
