from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.protocols.lmtp.ws_server import LmtpServer


class ServerThread:
    """An LMTP server on 127.0.0.1 (free port) with its own event loop in a background thread,
    so tests (and LMQL, which runs its own loop) connect to it like any outside client."""

    def __init__(self, engine: Any, **kw: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmtp-test-server", daemon=True)
        self.thread.start()
        self.server: LmtpServer = self.call(LmtpServer(engine, "127.0.0.1", 0, **kw).start())

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def lmtp_engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="session")
def lmtp_server(lmtp_engine):
    server = ServerThread(lmtp_engine)
    yield server
    server.stop()


def run(coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def engine_greedy(
    engine: Any, prompt: list[int], max_tokens: int, bias: dict[int, float] | None = None, top: int = 1
) -> tuple[list[int], list[float]]:
    """What the engine itself generates greedily, with logprobs as LMTP reports them."""
    opts = GenerateOptions(
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, logit_bias=bias or {}),
        logprobs=True,
        top_logprobs=top,
        logprob_mode="processed",
    )
    events, _ = engine.generate(None, prompt, opts).result()
    return [e.token_id for e in events], [e.logprob for e in events]


def engine_scores(engine: Any, prompt: list[int], scored: list[int]) -> list[float]:
    n = len(prompt)
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(n, n + len(scored))], logprob_mode="raw")
    events, _ = engine.generate(None, prompt + scored, opts).result()
    return [e.logprob for e in events]
