"""A running `tokenwire serve`, seen by an operator: /metrics moves by the right amounts after
known requests on each protocol, each request leaves one access-log line, the default start
stays under the memory bound, and SIGTERM ends open streams with the protocol's own error."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import kill_if_running, wait_ready

MODEL = "SmolLM2-135M-Instruct"
PROTOCOLS = ("lmtp", "salience", "evergreen", "graphpipe", "openai")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Server:
    def __init__(self) -> None:
        self.lmtp, self.grpc, self.graphpipe, self.http, self.metrics = _free_ports(5)
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tokenwire.cli", "--log-format", "json", "serve", "--kv-cache-mb", "64",
                "--lmtp-port", str(self.lmtp), "--grpc-port", str(self.grpc),
                "--graphpipe-port", str(self.graphpipe), "--http-port", str(self.http),
                "--metrics-port", str(self.metrics), "--shutdown-grace", "5",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.log = wait_ready(self.proc)

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    out[tuple(sorted(sample.labels.items()))] = sample.value
        return out

    def count(self, name: str, **labels: str) -> float:
        return sum(v for k, v in self.samples(name).items() if set(labels.items()) <= set(k))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        kill_if_running(s.proc)


def _lmtp(server: Server) -> int:
    from tokenwire.lmtp import Client

    async def go() -> int:
        async with await Client.connect(f"ws://127.0.0.1:{server.lmtp}/") as client:
            records = await client.generate_all([1, 504, 3458], max_tokens=4, temperature=0.0)
            return len(records)

    return asyncio.run(go())


def _salience(server: Server) -> int:
    from tokenwire.salience import Client

    with Client(f"127.0.0.1:{server.grpc}") as client:
        session = client.open()
        return len(list(session.generate([1, 504, 3458], max_tokens=3, top_k=1)))


def _evergreen(server: Server) -> int:
    from tokenwire.protocols.evergreen.client import EvergreenSession, GenerateConfig

    async def go() -> int:
        session = await EvergreenSession.connect(f"127.0.0.1:{server.grpc}")
        try:
            config = GenerateConfig(max_tokens=2, temperature=0.0, ignore_eos=True)
            await session.generate("Hi", config).text()
            return 2
        finally:
            await session.close()

    return asyncio.run(go())


def _graphpipe(server: Server) -> int:
    from tokenwire.graphpipe import Client

    with Client(f"http://127.0.0.1:{server.graphpipe}/") as client:
        client.execute(np.array([[1, 504, 3458]], dtype=np.int64))
    return 0


def _openai(server: Server) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


CALLS = {"lmtp": _lmtp, "salience": _salience, "evergreen": _evergreen, "graphpipe": _graphpipe,
         "openai": _openai}  # fmt: skip


def test_the_default_start_is_small_and_says_so(server: Server) -> None:
    assert "KV cache 64 MiB = " in server.log and "RSS " in server.log


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_metrics_count_each_protocols_requests(server: Server, protocol: str) -> None:
    before_requests = server.count("tokenwire_requests_total", protocol=protocol)
    before_tokens = server.count("tokenwire_generated_tokens_total", protocol=protocol)
    generated = CALLS[protocol](server)
    after = server.count("tokenwire_requests_total", protocol=protocol)
    assert after == before_requests + 1
    if protocol != "graphpipe":  # a tensor call: no generated tokens
        tokens = server.count("tokenwire_generated_tokens_total", protocol=protocol)
        assert tokens == before_tokens + generated
        assert server.count("tokenwire_time_to_first_token_seconds_count", protocol=protocol) >= 1
    assert server.count("tokenwire_kv_blocks", state="free") > 0
    assert server.count("tokenwire_graphpipe_batch_size_count") >= (1 if protocol == "graphpipe" else 0)


def test_sigterm_ends_a_salience_stream_with_unavailable_and_logs_every_protocol(server: Server) -> None:
    from tokenwire.salience import Client, SalienceError

    for protocol in PROTOCOLS:  # at least one request each, whatever ran before
        CALLS[protocol](server)
    errors: list[Exception] = []
    first = threading.Event()

    def stream() -> None:
        try:
            with Client(f"127.0.0.1:{server.grpc}") as client:
                session = client.open()
                for _ in session.generate([1, 504, 3458], max_tokens=5000, top_k=1, stop_token_ids=[]):
                    first.set()
        except SalienceError as exc:
            errors.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rest = server.proc.communicate(timeout=60)[1]
    thread.join(30)
    assert server.proc.returncode == 0 and time.monotonic() - started < 5 + 5
    assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
    assert "server shutting down" in str(errors[0])
    lines = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    access = [e for e in lines if e["logger"] == "tokenwire.access"]
    for protocol in PROTOCOLS:
        mine = [e for e in access if e["protocol"] == protocol]
        assert mine, f"no access-log line for {protocol}: {access}"
        assert {"method", "outcome", "duration_s"} <= set(mine[-1])
