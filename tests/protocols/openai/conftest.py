"""A live `tokenwire serve` (only the OpenAI API on) on SmolLM2, the official `openai` client
against it, and the in-process engine as the oracle for what the API must return."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve_process import kill_if_running, stop_cleanly, wait_ready

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_only_serve(*args: str) -> Iterator[tuple[int, str]]:
    """`tokenwire serve` with only the OpenAI API on (every other listener off) and `args`;
    yields (port, the start-up log), stops it cleanly after."""
    port = free_port()
    off = ["--lmtp-port", "0", "--grpc-port", "0", "--graphpipe-port", "0", "--metrics-port", "0"]
    serve = [sys.executable, "-m", "tokenwire.cli", "serve", "--kv-cache-mb", "256", "--http-port", str(port)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen([*serve, *args, *off], **quiet)
    try:
        log = wait_ready(proc)
        yield port, log
        stop_cleanly(proc)
    finally:
        kill_if_running(proc)


@pytest.fixture(scope="session")
def openai_server() -> Iterator[str]:
    """Base URL (…/v1) of a `tokenwire serve` with only the OpenAI API on and an API key."""
    with openai_only_serve("--api-key", API_KEY) as (port, log):
        assert f"OpenAI API listening on http://127.0.0.1:{port}/v1" in log
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="session")
def client(openai_server: str) -> Any:
    import openai

    return openai.OpenAI(base_url=openai_server, api_key=API_KEY, max_retries=0, timeout=120)


def http(method: str, url: str, body: Any = None, key: str | None = API_KEY) -> tuple[int, dict, Any]:
    """A raw request: (status, headers, parsed JSON body) whatever the status."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


def metric(root: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (open, like /health; 0 while the series does not exist)."""
    import re

    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        found = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if found and dict(re.findall(r'(\w+)="([^"]*)"', found[1])) == labels:
            return float(found[2])
    return 0.0


@pytest.fixture(scope="session")
def root(openai_server: str) -> str:
    return openai_server.removesuffix("/v1")


class InProcess:
    """An OpenAIServer over `engine` on its own event loop thread (for tests that need the engine
    or the server object itself)."""

    def __init__(self, engine: Any, **options: Any) -> None:
        import asyncio
        import threading

        from tokenwire.protocols.openai.transport import OpenAIServer

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(OpenAIServer(engine, "127.0.0.1", 0, **options).start())
        self.url = self.server.url

    def call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.server is not None:
            self.call(self.server.stop())
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def random_engine(smollm2_source: Any) -> Iterator[Any]:
    """The engine on the no-model backend (RandomTokenModel): real scheduling, no forward pass."""
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    engine = Engine(
        lambda: RandomTokenModel(smollm2_source.config),
        smollm2_source.tokenizer,
        name=MODEL,
        kv_cache_mb=64,
        max_running=1,
    )
    yield engine
    engine.shutdown()
