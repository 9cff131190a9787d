"""AICI after a refusal (issue 29, finding 2): a /v1/run refused at a capacity cap is a complete
HTTP error naming the cap and its flag, answered before any stream starts; it leaves nothing
behind (no session, KV block or Coordinator sequence); the runs after it work and the server
does not spin. Oversized and malformed uploads are 413 / 400 in AICI REST's form.

The servers run in this process on the no-model engine (real scheduler, sessions, KV blocks);
the AICI REST server is started beside them on the same engine so its Coordinator can be read.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.reliability.conftest import Servers, idle_baseline, random_engine_of, wait_idle
from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.rest import MAX_WASM_BYTES, AiciServer, tokenizer_spec
from tokenwire.protocols.salience.client import AsyncClient as SalienceClient

RUN = {"controller": "regex", "controller_arg": "[a-z]+", "prompt": "Hello", "max_tokens": 4}
TIMEOUT = aiohttp.ClientTimeout(total=30)  # a run that hangs fails the test instead of blocking it


class Aici:
    def __init__(self, servers: Servers, server: AiciServer) -> None:
        self.servers = servers
        self.server = server

    def call(self, method: str, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        """A request to AICI REST (`path`) or to another server (a whole URL)."""
        url = path if path.startswith("http") else self.server.url + path

        async def go() -> tuple[int, dict[str, str], bytes]:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.request(method, url, **kw) as r:
                return r.status, dict(r.headers), await r.read()

        return asyncio.run(go())

    def run(self, body: dict[str, Any] = RUN) -> tuple[int, dict[str, str], bytes]:
        return self.call("POST", "/v1/run", json=body)

    def run_ok(self) -> str:
        status, headers, raw = self.run()
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), raw
        chunks = [c for c in raw.decode().split("\n\n") if c]
        assert chunks[-1] == "data: [DONE]", chunks[-3:]
        events = [json.loads(c[6:]) for c in chunks[:-1]]
        forks = [f for e in events[1:] for f in e["forks"]]
        assert forks and forks[-1]["finish_reason"] in ("aici-stop", "length"), forks
        assert all(not f["error"] for f in forks), forks
        return "".join(f["text"] for f in forks)


@pytest.fixture(scope="module")
def engine(smollm2_source: Any) -> Iterator[Any]:
    """A KV budget (4 MiB) below the context, so one prompt can need more than all of it."""
    engine = random_engine_of(smollm2_source, kv_cache_mb=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def aici(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Aici]:
    servers = Servers(engine)
    client = AiciClient(
        tokenizer=tokenizer_spec(engine),
        runtime_args=[f"--store-dir={tmp_path_factory.mktemp('aici-recovery')}", "--max-pre-ms=50"],
    )
    server = servers.call(AiciServer(engine, client, port=0).start())
    yield Aici(servers, server)
    servers.call(server.stop())
    client.close()
    servers.stop()


def _assert_refused(aici: Aici, status: int, flag: str) -> None:
    got, headers, raw = aici.run()
    assert got == status, (got, raw)
    assert headers["Content-Type"].startswith("application/json"), headers
    message = json.loads(raw)["error"]  # a whole JSON answer, not a stream cut short
    assert flag in message, message


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds used so far by this process (all its threads: the servers run here) or by `pid`."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _assert_quiet(aici: Aici) -> None:
    """Idle for a second: this process and the runtime use little CPU (the bug spun at 200 %)."""
    runtime_pid = aici.server.client.proc.pid
    own, runtime = _cpu_s(), _cpu_s(runtime_pid)
    time.sleep(1.0)
    own, runtime = _cpu_s() - own, _cpu_s(runtime_pid) - runtime
    assert own < 0.3 and runtime < 0.3, f"spinning: {own:.2f} s here, {runtime:.2f} s in the runtime"


def _assert_nothing_left(aici: Aici, engine: Any, baseline: dict[str, Any]) -> None:
    wait_idle(engine, baseline, timeout=5)
    coord = aici.server.coord
    assert coord is not None
    deadline = time.monotonic() + 5
    while coord.seqs:  # refused runs' controllers are dropped within the next rounds
        assert time.monotonic() < deadline, f"sequences left in the Coordinator: {coord.seqs}"
        time.sleep(0.01)


def test_runs_refused_at_every_cap_then_run_again(aici: Aici, engine: Any) -> None:
    baseline = idle_baseline(engine)
    assert aici.run_ok()  # a run works before anything

    # --max-sessions, filled by OpenAI /v1/sessions and a Salience session
    engine.max_sessions = engine.stats()["sessions"] + 3
    openai = aici.servers.url("http")
    opened = []
    for _ in range(2):
        status, _, raw = aici.call("POST", openai + "/sessions", json={})
        assert status == 200, raw
        opened.append(json.loads(raw)["id"])

    async def salience_session() -> tuple[SalienceClient, Any]:
        client = SalienceClient(aici.servers.url("grpc"))
        return client, await client.open()

    salience, salience_session_handle = aici.servers.call(salience_session())
    try:
        assert engine.stats()["sessions"] == engine.max_sessions
        for _ in range(3):
            _assert_refused(aici, 429, "--max-sessions")
    finally:
        aici.servers.call(salience_session_handle.close())
        aici.servers.call(salience.close())
        for sid in opened:
            assert aici.call("DELETE", f"{openai}/sessions/{sid}")[0] == 200
        engine.max_sessions = None

    # --max-queued: the session is made and the controller instantiated, then the engine refuses
    engine.max_queued = 0
    try:
        for _ in range(3):
            _assert_refused(aici, 429, "--max-queued")
    finally:
        engine.max_queued = None

    # --kv-cache-mb: a prompt that alone needs more blocks than the whole budget (within the context)
    budget = engine.kv.num_blocks * engine.kv.block_size
    assert budget < engine.max_model_len
    status, _, raw = aici.run({**RUN, "prompt": [42] * budget})
    assert status == 400 and "--kv-cache-mb" in json.loads(raw)["error"], (status, raw[:300])

    # capacity back: runs work again, every time, and nothing was left behind or keeps running
    for _ in range(3):
        assert aici.run_ok()
    _assert_nothing_left(aici, engine, baseline)
    _assert_quiet(aici)


def test_a_cap_reached_at_a_fork_fails_that_fork_and_the_next_runs_work(aici: Aici, engine: Any) -> None:
    """A controller that forks while --max-sessions is full: the fork fails with the engine's
    message (a complete stream), its clones are freed, and later runs are not stalled."""
    baseline = idle_baseline(engine)
    program = {"steps": [{"fixed": "A"}, {"fork": [[{"fixed": "x"}], [{"fixed": "y"}], [{"fixed": "z"}]]}]}
    engine.max_sessions = engine.stats()["sessions"] + 1  # room for the run's own session only
    try:
        status, _, raw = aici.run({"controller": "declctrl", "controller_arg": program, "max_tokens": 8})
    finally:
        engine.max_sessions = None
    assert status == 200, raw
    chunks = [c for c in raw.decode().split("\n\n") if c]
    assert chunks[-1] == "data: [DONE]", chunks[-3:]
    forks = [f for c in chunks[1:-1] for f in json.loads(c[6:])["forks"]]
    assert any(f["finish_reason"] == "fail" and "--max-sessions" in f["error"] for f in forks), forks
    for _ in range(2):
        assert aici.run_ok()
    _assert_nothing_left(aici, engine, baseline)
    _assert_quiet(aici)


def test_oversized_and_malformed_uploads(aici: Aici, engine: Any) -> None:
    baseline = idle_baseline(engine)
    garbage = os.urandom(60 * 2**20)  # the 60 MB garbage upload of the issue
    status, headers, raw = aici.call("POST", "/v1/controllers", data=garbage)
    assert status == 413 and headers["Content-Type"].startswith("application/json"), (status, raw[:300])
    assert str(MAX_WASM_BYTES) in json.loads(raw)["error"]

    async def chunks() -> Any:  # no Content-Length: the cap is found while reading
        for i in range(0, MAX_WASM_BYTES + 2**20, 2**20):
            yield garbage[i : i + 2**20]

    status, _, raw = aici.call("POST", "/v1/controllers", data=chunks())
    assert status == 413 and str(MAX_WASM_BYTES) in json.loads(raw)["error"], (status, raw[:300])

    # the largest upload allowed reaches the runtime (it fits its channel) and is refused as not Wasm
    status, _, raw = aici.call("POST", "/v1/controllers", data=garbage[:MAX_WASM_BYTES])
    assert status == 400 and "error" in json.loads(raw), (status, raw[:300])
    status, _, raw = aici.call("POST", "/v1/controllers", data=b"\0asm garbage")
    assert status == 400 and "error" in json.loads(raw), (status, raw[:300])
    status, _, raw = aici.run({**RUN, "prompt": "x" * (MAX_WASM_BYTES + 1)})
    assert status == 413 and str(MAX_WASM_BYTES) in json.loads(raw)["error"], (status, raw[:300])

    assert aici.run_ok()
    _assert_nothing_left(aici, engine, baseline)
