"""A running `tokenwire serve`, seen by an operator: /metrics moves by the right amounts after
known requests on each protocol (AICI included), each request leaves one access-log line (also
those that never generate: Salience session RPCs, Evergreen token tools, AICI REST calls), the
default start stays under the memory bound, and SIGTERM ends the open stream of every protocol
with that protocol's own "server shutting down" error, then exits 0 within --shutdown-grace."""

from __future__ import annotations

import asyncio
import json
import signal
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
from tokenwire.bench.inprocess import free_ports

MODEL = "SmolLM2-135M-Instruct"
PROTOCOLS = ("lmtp", "salience", "evergreen", "graphpipe", "aici", "openai")
GRACE = 5.0


class Server:
    def __init__(self) -> None:
        self.lmtp, self.grpc, self.graphpipe, self.http, self.metrics, self.aici = free_ports(6)
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tokenwire.cli", "--log-format", "json", "serve", "--kv-cache-mb", "64",
                "--lmtp-port", str(self.lmtp), "--grpc-port", str(self.grpc),
                "--graphpipe-port", str(self.graphpipe), "--http-port", str(self.http),
                "--metrics-port", str(self.metrics), "--shutdown-grace", str(GRACE),
                "--aici", "--aici-port", str(self.aici), "--max-num-seqs", "8",
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


def _aici_post(server: Server, path: str, body: bytes, content_type: str, timeout: float = 120):
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.aici}{path}", data=body, headers={"Content-Type": content_type}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def _aici_events(response) -> Iterator[dict]:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _aici(server: Server) -> int:
    body = {
        "controller": "regex",
        "controller_arg": "[a-z]+( [a-z]+){2}",
        "prompt": "A poem:",
        "max_tokens": 8,
    }
    with _aici_post(server, "/v1/run", json.dumps(body).encode(), "application/json") as r:
        events = list(_aici_events(r))
    runs = [e for e in events if e["object"] == "run"]
    assert runs and runs[-1]["forks"][-1]["finish_reason"] in ("aici-stop", "length"), events
    return int(runs[-1]["usage"]["sampled_tokens"])


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
         "aici": _aici, "openai": _openai}  # fmt: skip


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


def _non_generating_requests(server: Server) -> None:
    """Requests that never reach the engine: each must still leave its access-log line."""
    from tokenwire.protocols.evergreen.client import EvergreenSession
    from tokenwire.salience import Client

    with Client(f"127.0.0.1:{server.grpc}") as client:
        session = client.open()
        session.dump()
        session.close()

    async def evergreen() -> None:
        session = await EvergreenSession.connect(f"127.0.0.1:{server.grpc}")
        try:
            assert await session.tokenize("Hello there")
            assert await session.count_tokens("Hello there") > 0
        finally:
            await session.close()

    asyncio.run(evergreen())
    with urllib.request.urlopen(f"http://127.0.0.1:{server.aici}/v1/controllers/tags", timeout=30) as r:
        assert r.status == 200
    wasmtime = pytest.importorskip("wasmtime")
    from tests.protocols.aici.test_runtime_shm import TINY_WAT

    with _aici_post(server, "/v1/controllers", wasmtime.wat2wasm(TINY_WAT % 7), "application/wasm") as r:
        assert json.loads(r.read())["module_id"]


class LongStreams:
    """One long generation per protocol, each in its own thread; `errors[protocol]` is what its
    client saw when the stream ended (None: it ended without an error)."""

    PROMPT = (1, 504, 3458)
    MAX_TOKENS = 1500

    def __init__(self, server: Server) -> None:
        self.server = server
        self.started = {p: threading.Event() for p in PROTOCOLS}
        self.errors: dict[str, object] = {}
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in PROTOCOLS]
        self.graphpipe = self.threads[PROTOCOLS.index("graphpipe")]
        self.started["graphpipe"].set()  # started on its own (`graphpipe.start()`)

    def start(self) -> None:
        for thread in self.threads:
            if thread is not self.graphpipe:
                thread.start()

    def _run(self, protocol: str) -> None:
        try:
            getattr(self, "_" + protocol)()
            self.errors[protocol] = None
        except Exception as exc:  # what the client raised is the point of the test
            self.errors[protocol] = exc
        finally:
            self.started[protocol].set()

    def _lmtp(self) -> None:
        from tokenwire.lmtp import Client

        async def go() -> None:
            async with await Client.connect(f"ws://127.0.0.1:{self.server.lmtp}/") as client:
                stream = client.generate(list(self.PROMPT), max_tokens=self.MAX_TOKENS, ignore_eos=True)
                async for _ in stream:
                    self.started["lmtp"].set()

        asyncio.run(go())

    def _salience(self) -> None:
        from tokenwire.salience import Client

        with Client(f"127.0.0.1:{self.server.grpc}") as client:
            session = client.open()
            tokens = session.generate(
                list(self.PROMPT), max_tokens=self.MAX_TOKENS, top_k=1, stop_token_ids=[]
            )
            for _ in tokens:
                self.started["salience"].set()

    def _evergreen(self) -> None:
        from tokenwire.protocols.evergreen.client import EvergreenSession, GenerateConfig

        async def go() -> None:
            session = await EvergreenSession.connect(f"127.0.0.1:{self.server.grpc}")
            try:
                config = GenerateConfig(max_tokens=self.MAX_TOKENS, temperature=0.0, ignore_eos=True)
                async for _ in session.generate("Tell me a long story.", config):
                    self.started["evergreen"].set()
            finally:
                await session.close()

        asyncio.run(go())

    def _graphpipe(self) -> None:
        from tokenwire.graphpipe import Client

        # one forward over many rows: in flight a while on a CPU (short enough to end in the grace:
        # a torch forward cannot be interrupted, and its thread must finish before the exit)
        rows = np.tile(np.arange(1, 257, dtype=np.int64), (8, 1))
        with Client(f"http://127.0.0.1:{self.server.graphpipe}/", timeout=120) as client:
            client.execute(rows)

    def _aici(self) -> None:
        body = {"controller": "regex", "controller_arg": "[a-z ]{6000}", "prompt": "A story:",
                "max_tokens": self.MAX_TOKENS}  # fmt: skip
        with _aici_post(self.server, "/v1/run", json.dumps(body).encode(), "application/json") as r:
            self.errors["aici-events"] = events = []
            for event in _aici_events(r):
                events.append(event)
                if event["object"] == "run" and any(f["text"] for f in event["forks"]):
                    self.started["aici"].set()

    def _openai(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": self.MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.http}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        self.errors["openai-events"] = events = []
        with urllib.request.urlopen(request, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    self.started["openai"].set()


def test_sigterm_ends_every_protocols_stream_with_its_shutdown_error_and_logs_every_request(
    server: Server,
) -> None:
    from tokenwire.lmtp import LmtpError
    from tokenwire.protocols.evergreen.client import EvergreenError
    from tokenwire.protocols.graphpipe.client import GraphPipeClientError
    from tokenwire.protocols.graphpipe.errors import ErrorCode
    from tokenwire.salience import SalienceError

    for protocol in PROTOCOLS:  # at least one request each, whatever ran before
        CALLS[protocol](server)
    _non_generating_requests(server)
    streams = LongStreams(server)
    streams.start()
    for protocol in PROTOCOLS:
        assert streams.started[protocol].wait(120), f"{protocol} stream never started"
        assert protocol not in streams.errors, (protocol, streams.errors[protocol])
    streams.graphpipe.start()  # last: a single forward, not a stream
    time.sleep(0.2)  # the GraphPipe forward is under way
    server.proc.send_signal(signal.SIGTERM)
    rest = server.proc.communicate(timeout=60)[1]  # hang guard: 12x the grace
    for thread in streams.threads:
        thread.join(30)
    errors = streams.errors
    # within the grace, by what happened: the hard deadline (shutdown.py) would have ended the
    # process with status 1 and its line; the model thread was free within a layer of shutdown
    # (the GraphPipe forward polls Engine.stopping between layers), so the process did not
    # have to exit around a running step; the stop's lines came in order
    assert server.proc.returncode == 0, rest
    assert "did not finish within --shutdown-grace" not in rest, rest[-3000:]
    assert "exiting with the model thread still in its step" not in rest, rest[-3000:]
    said = [json.loads(line)["message"] for line in rest.splitlines() if line.startswith("{")]
    assert "shutting down (grace 5s)" in said and "stopped" in said, said[-20:]
    assert said.index("shutting down (grace 5s)") < said.index("stopped"), said[-20:]

    salience = errors["salience"]
    assert isinstance(salience, SalienceError) and salience.code == grpc.StatusCode.UNAVAILABLE, errors
    assert "server shutting down" in str(salience)
    evergreen = errors["evergreen"]
    assert isinstance(evergreen, EvergreenError) and evergreen.code == "UNAVAILABLE", errors
    assert "server shutting down" in evergreen.details
    lmtp = errors["lmtp"]
    assert isinstance(lmtp, LmtpError) and "server shutting down" in str(lmtp), errors
    graphpipe = errors["graphpipe"]
    assert isinstance(graphpipe, GraphPipeClientError), errors
    assert graphpipe.code == ErrorCode.UNAVAILABLE and "server shutting down" in str(graphpipe)
    aici_last = errors["aici-events"][-1]
    assert errors["aici"] is None, errors
    assert aici_last["forks"][0]["error"] == "server shutting down", aici_last
    assert aici_last["forks"][0]["finish_reason"] == "fail"
    openai_last = errors["openai-events"][-1]
    assert errors["openai"] is None, errors
    assert openai_last["error"]["code"] == "shutting_down" and "server shutting down" in str(openai_last)

    lines = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    access = [e for e in lines if e["logger"] == "tokenwire.access"]
    for protocol in PROTOCOLS:
        mine = [e for e in access if e["protocol"] == protocol]
        assert mine, f"no access-log line for {protocol}: {access}"
        assert {"method", "outcome", "duration_s"} <= set(mine[-1])
    methods = {(e["protocol"], e["method"]) for e in access}
    for expected in [
        ("salience", "OpenSession"), ("salience", "DumpSession"), ("salience", "CloseSession"),
        ("evergreen", "TOKENIZE"), ("evergreen", "COUNT_TOKENS"),
        ("aici", "GET /v1/controllers/tags"), ("aici", "POST /v1/controllers"), ("aici", "POST /v1/run"),
    ]:  # fmt: skip
        assert expected in methods, (expected, sorted(methods))
