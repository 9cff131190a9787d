"""Faults survived: a client that vanishes mid-stream leaves the engine idle (no running or
waiting request, KV blocks and sessions back to their baseline) with its request ended early,
a few tokens of its 4000 computed, on every protocol; the AICI runtime child killed with
SIGKILL fails its run clearly and is restarted. Ended early is counted in tokens, not timed:
the waits for idle are hang guards."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from tests.reliability.conftest import MODEL, Servers, idle_baseline, wait_idle

LONG = 4000  # tokens: far more than any test waits for


def idle_and_ended_early(engine: Any, baseline: dict[str, Any]) -> dict[str, Any]:
    """wait_idle, and the request(s) since `baseline` ended with their client: fewer tokens
    computed than one LONG request runs to its end."""
    stats = wait_idle(engine, baseline)
    ran = stats["computed_tokens"] - baseline["computed_tokens"]
    assert ran < LONG, f"{ran} tokens computed: the request ran on after its client was gone"
    return stats


@pytest.fixture(scope="module")
def servers(engine: Any, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("aici-store")
    servers = Servers(engine, "--aici-store-dir", str(store), aici=True)
    yield servers
    servers.stop()


def _running(engine: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)


def test_lmtp_disconnect_frees_everything(servers: Servers, engine: Any) -> None:
    baseline = idle_baseline(engine)

    async def vanish() -> None:
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(servers.url("lmtp"))
            request = {
                "stream_id": 1,
                "model": MODEL,
                "prompt": [1, 2, 3],
                "max_tokens": LONG,
                "ignore_eos": True,
            }
            await ws.send_str("GENERATE " + json.dumps(request))
            await ws.receive()  # tokens are flowing
            ws._response.connection.transport.abort()  # type: ignore[union-attr]  # no close frame

    asyncio.run(asyncio.wait_for(vanish(), 30))
    idle_and_ended_early(engine, baseline)


def test_salience_disconnect_ends_the_request(servers: Servers, engine: Any) -> None:
    from tokenwire.protocols.salience.gen import salience_pb2 as pb
    from tokenwire.protocols.salience.gen import salience_pb2_grpc as pb_grpc

    baseline = idle_baseline(engine)
    channel = grpc.insecure_channel(servers.url("grpc"))
    stub = pb_grpc.SalienceStub(channel)
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    stream = stub.Generate(
        pb.GenerateRequest(session_id=sid, append_tokens=[1, 2, 3], offset=0, max_tokens=LONG)
    )
    next(iter(stream))
    channel.close()  # the client vanishes mid-stream
    # the session is the client's to keep (it may reconnect), with its KV; its request ends
    deadline = time.monotonic() + 10  # hang guard
    while (engine.stats()["running"], engine.stats()["waiting"]) != (0, 0):
        assert time.monotonic() < deadline, ("the request never ended", engine.stats())
        time.sleep(0.01)
    with grpc.insecure_channel(servers.url("grpc")) as again:
        pb_grpc.SalienceStub(again).CloseSession(pb.CloseSessionRequest(session_id=sid))
    idle_and_ended_early(engine, baseline)


def test_evergreen_disconnect_frees_everything(servers: Servers, engine: Any) -> None:
    from tokenwire.protocols.evergreen.client import Chat, EvergreenSession, GenerateConfig

    baseline = idle_baseline(engine)

    async def vanish() -> None:
        session = await EvergreenSession.connect(servers.url("grpc"))
        chat = Chat(session, None, "")
        config = GenerateConfig(max_tokens=LONG, temperature=0.0)
        async for _text in chat.say("Hi", config):
            break  # text arrived: generation is running
        await session.channel.close()  # the whole connection goes, no goodbye

    asyncio.run(asyncio.wait_for(vanish(), 30))
    idle_and_ended_early(engine, baseline)


def test_openai_disconnect_frees_everything(servers: Servers, engine: Any) -> None:
    baseline = idle_baseline(engine)
    for stream in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", servers.ports["http"], timeout=30)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "stream": stream}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            conn.getresponse().read(64)  # the first event arrived
        else:
            _running(engine)
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        conn.close()
        baseline = idle_and_ended_early(engine, baseline)


def test_graphpipe_disconnect_mid_request(servers: Servers, engine: Any) -> None:
    """GraphPipe's LM runs whole forward passes (no engine request, no KV): a client gone
    before its answer leaves nothing behind, and the next request is answered."""
    from tokenwire.protocols.graphpipe.client import Client, build_request

    baseline = idle_baseline(engine)
    body = bytes(build_request([np.arange(1, 257, dtype=np.int64).reshape(1, -1)], None, None, None))
    for cut in (len(body) // 2, len(body)):  # mid-body, and after the whole request
        with socket.create_connection(("127.0.0.1", servers.ports["graphpipe"])) as sock:
            head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            sock.sendall(head + body[:cut])
    with Client(servers.url("graphpipe")) as client:
        assert client.execute(np.array([[1, 2, 3]], dtype=np.int64), output_name="logits").shape[-1] > 0
    wait_idle(engine, baseline)


def _sse(
    port: int, body: dict[str, Any], *, until_first_run: bool = False
) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/run", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _events(response: Any) -> list[Any]:
    """The SSE events left in `response` (after a readline() the rest starts with the blank line
    that ended the first event: strip it, or the next event would be lost)."""
    chunks = [x.strip() for x in response.read().decode().split("\n\n")]
    return [json.loads(x[6:]) for x in chunks if x.startswith("data: ") and x != "data: [DONE]"]


def test_aici_disconnect_frees_everything(servers: Servers, engine: Any) -> None:
    baseline = idle_baseline(engine)
    conn, response = _sse(
        servers.ports["aici"], {"controller": "regex", "controller_arg": "[a-z ]*", "max_tokens": LONG}
    )
    assert response.status == 200
    response.readline()  # the initial-run event
    _running(engine)
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    idle_and_ended_early(engine, baseline)


def _runtime_pids() -> set[int]:
    """This process's tokenwire-aicirt children."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"aicirt" in cmdline:
            pids.add(int(entry.name))
    return pids


def test_aici_runtime_sigkill_fails_the_run_then_restarts(servers: Servers, engine: Any) -> None:
    baseline = idle_baseline(engine)
    (pid,) = _runtime_pids()
    conn, response = _sse(
        servers.ports["aici"], {"controller": "regex", "controller_arg": "[a-z ]*", "max_tokens": LONG}
    )
    assert response.status == 200
    response.readline()
    _running(engine)
    os.kill(pid, signal.SIGKILL)
    events = _events(response)  # the stream ends (no hang) ...
    conn.close()
    failed = [f for e in events for f in e.get("forks", []) if f.get("finish_reason") == "fail"]
    assert failed and "AICI runtime" in failed[-1]["error"], events[-3:]  # ... with a clear error
    idle_and_ended_early(engine, baseline)

    deadline = time.monotonic() + 60
    while True:  # serve restarts the runtime; runs work again
        conn, response = _sse(servers.ports["aici"], {"controller": "regex", "controller_arg": "ok"})
        if response.status == 200:
            forks = [f for e in _events(response)[1:] for f in e["forks"]]
            assert "".join(f["text"] for f in forks) == "ok", forks
            break
        body = json.loads(response.read())
        assert response.status == 503 and "restarting" in body["error"], body
        assert time.monotonic() < deadline, "the runtime never came back"
        time.sleep(0.2)
    conn.close()
    new_pids = _runtime_pids()
    assert len(new_pids) == 1 and pid not in new_pids
