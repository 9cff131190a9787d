"""The limits of docs/limits.md: each cap refuses with the protocol's own error naming the flag,
and the server goes on serving."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import grpc
import pytest

from tests.reliability.conftest import MODEL, Servers, random_engine_of, serve_args
from tokenwire.engine.errors import CapacityError
from tokenwire.engine.request import GenerateOptions


def test_engine_caps_sessions_and_queue(smollm2_source: Any) -> None:
    engine = random_engine_of(smollm2_source)
    try:
        engine.max_sessions = 2
        first, _second = engine.create_session(), engine.create_session()
        with pytest.raises(CapacityError, match=r"too many open sessions: 2 \(--max-sessions 2\)"):
            engine.create_session()
        with pytest.raises(CapacityError, match="--max-sessions"):
            engine.fork_session(first)
        engine.close_session(first)
        engine.create_session()  # room again
        engine.max_queued = 0
        with pytest.raises(CapacityError, match=r"--max-queued 0"):
            engine.generate(None, [1, 2, 3], GenerateOptions(max_tokens=2))
        engine.max_queued = None
        events, finish = engine.generate(None, [1, 2, 3], GenerateOptions(max_tokens=2)).result()
        assert len(events) == 2 and finish.reason == "length"
    finally:
        engine.shutdown()


def test_limit_flags_are_checked_and_reach_the_engine_settings() -> None:
    from tokenwire.cli_args import settings_from
    from tokenwire.protocols import limits

    args = serve_args("--max-sessions", "7", "--max-queued", "3")
    settings = settings_from(args)
    assert (settings.max_sessions, settings.max_queued) == (7, 3)
    assert serve_args().max_sessions == limits.DEFAULT_MAX_SESSIONS
    with pytest.raises(ValueError, match="--idle-timeout must be positive"):
        asyncio.run(limits.bind(serve_args("--idle-timeout", "0")))


@pytest.fixture(scope="module")
def servers(engine: Any):
    servers = Servers(engine, "--idle-timeout", "0.5", "--max-streams-per-connection", "2")
    yield servers
    servers.stop()


def test_every_protocol_refuses_over_capacity(servers: Servers, engine: Any) -> None:
    from tokenwire.lmtp import Client, LmtpError
    from tokenwire.protocols.evergreen.client import Chat, EvergreenError, EvergreenSession, GenerateConfig
    from tokenwire.protocols.salience.client import AsyncClient, SalienceError

    engine.max_sessions = engine.stats()["sessions"]  # full: no new session anywhere
    try:

        async def salience() -> str:
            client = AsyncClient(servers.url("grpc"))
            try:
                await client.open()
                return "opened"
            except SalienceError as exc:
                return str(exc)
            finally:
                await client.channel.close()

        assert "--max-sessions" in asyncio.run(salience())

        request = urllib.request.Request(
            servers.url("http") + "/sessions",
            data=b'{"prompt": "Hi"}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        body = json.loads(caught.value.read())
        assert caught.value.code == 429 and body["error"]["code"] == "server_overloaded", body
        assert "--max-sessions" in body["error"]["message"]
    finally:
        engine.max_sessions = None

    engine.max_queued = 0  # every new request is refused
    try:

        async def lmtp() -> str:  # codes ride on the retry extension's records
            async with await Client.connect(servers.url("lmtp"), extensions=["text", "retry"]) as client:
                try:
                    await client.complete("Hi", max_tokens=2)
                except LmtpError as exc:
                    return f"{exc.code} {exc.retryable} {exc}"
            return "ran"

        assert asyncio.run(lmtp()).startswith("overloaded True the server is saturated")

        async def evergreen() -> str:
            session = await EvergreenSession.connect(servers.url("grpc"))
            try:
                chat = Chat(session, None, "")
                return "".join([t async for t in chat.say("Hi", GenerateConfig(max_tokens=2))])
            except EvergreenError as exc:
                return f"{exc.code} {exc.details}"
            finally:
                await session.close()

        answer = asyncio.run(asyncio.wait_for(evergreen(), 30))
        assert answer.startswith("RESOURCE_EXHAUSTED") and "--max-queued" in answer, answer

    finally:
        engine.max_queued = None

    async def works() -> str:  # and everyone is served again
        async with await Client.connect(servers.url("lmtp"), extensions=["text"]) as client:
            return await client.complete("Hi", max_tokens=2)

    assert isinstance(asyncio.run(works()), str)


def test_http_protocols_refuse_over_max_queued(engine: Any) -> None:
    """--max-queued 0: GraphPipe (its own in-flight count: it calls the model directly) and the
    OpenAI API (the engine's queue) refuse every request with their 429."""
    import numpy as np

    from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError

    servers = Servers(engine, "--max-queued", "0", "--http-max-body-mb", "0.01")
    try:
        with Client(servers.url("graphpipe")) as client:
            with pytest.raises(GraphPipeClientError) as caught:
                client.execute(np.array([[1, 2, 3]], dtype=np.int64))
        assert caught.value.code == 12 and caught.value.status == 429
        assert "--max-queued 0" in str(caught.value)
        request = urllib.request.Request(
            servers.url("http") + "/completions",
            data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(request, timeout=30)
        assert http_error.value.code == 429, http_error.value.read()
        # the body cap: a declared length and a chunked body over 10 KiB, both 413 unread
        big = json.dumps({"model": MODEL, "prompt": "x" * 20_000}).encode()
        for chunked in (False, True):
            conn = http.client.HTTPConnection("127.0.0.1", servers.ports["http"], timeout=30)
            headers = {"Content-Type": "application/json"}
            body: Any = iter([big[i : i + 4096] for i in range(0, len(big), 4096)]) if chunked else big
            conn.request("POST", "/v1/completions", body=body, headers=headers, encode_chunked=chunked)
            reply = conn.getresponse()
            error = json.loads(reply.read())["error"]
            assert reply.status == 413 and error["code"] == "request_too_large", (chunked, error)
            assert "--http-max-body-mb" in error["message"]
            conn.close()
    finally:
        servers.stop()


def test_lmtp_streams_per_connection(servers: Servers) -> None:
    from tokenwire.lmtp import Client, LmtpError

    async def run() -> None:
        async with await Client.connect(servers.url("lmtp"), extensions=["text", "retry"]) as client:
            long = [
                asyncio.ensure_future(client.generate_all("Hi", max_tokens=400, ignore_eos=True))
                for _ in range(2)
            ]
            await asyncio.sleep(0.1)
            with pytest.raises(LmtpError) as caught:
                await client.complete("Hi", max_tokens=2)
            assert caught.value.code == "too_many_streams" and caught.value.retryable
            assert "--max-streams-per-connection 2" in str(caught.value)
            for records in await asyncio.gather(*long):
                assert records[-1]["finish_reason"] == "length"
            assert isinstance(await client.complete("Hi", max_tokens=2), str)  # room again

    asyncio.run(asyncio.wait_for(run(), 60))


def test_idle_lmtp_connection_is_closed(servers: Servers) -> None:
    """Closed by the server for its idleness (--idle-timeout 0.5: code 1000, reason "idle
    timeout"), not before the timeout; the 10 s wait is a hang guard."""

    async def run() -> tuple[Any, Any, Any, float]:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(servers.url("lmtp")) as ws:
                started = loop.time()
                msg = await asyncio.wait_for(ws.receive(), 10)
                return msg.type, ws.close_code, msg.extra, loop.time() - started

    kind, code, reason, waited = asyncio.run(run())
    assert kind == aiohttp.WSMsgType.CLOSE and code == 1000 and reason == "idle timeout", (kind, code, reason)
    assert waited > 0.4, waited


def test_grpc_connection_limits_are_set(servers: Servers) -> None:
    """The gRPC server is built with the per-connection stream cap and the idle close (grpc's
    own options, which grpc enforces); health answers on it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tokenwire.protocols.grpc_server import GrpcServer

    server = GrpcServer(
        None, serve_args("--max-streams-per-connection", "5", "--idle-timeout", "2"), "127.0.0.1", 0
    )
    options = server.server_options()
    assert ("grpc.max_concurrent_streams", 5) in options and ("grpc.max_connection_idle_ms", 2000) in options
    with grpc.insecure_channel(servers.url("grpc")) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_bytes_that_do_not_parse_get_invalid_argument(servers: Servers) -> None:
    """reliability-findings.md: undecodable Salience requests came back UNKNOWN; now
    INVALID_ARGUMENT naming the method, for unary and server-streaming RPCs alike."""
    from tokenwire.protocols.salience.gen import salience_pb2 as pb

    with grpc.insecure_channel(servers.url("grpc")) as channel:
        for method, streaming in (("OpenSession", False), ("Generate", True)):
            call = (channel.unary_stream if streaming else channel.unary_unary)(
                f"/salience.v1.Salience/{method}"
            )
            with pytest.raises(grpc.RpcError) as caught:
                result = call(b"\xff\xff\xff\x07garbage", timeout=10)
                if streaming:
                    list(result)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert method in caught.value.details() and "not a valid message" in caught.value.details()
        open_session = channel.unary_unary(
            "/salience.v1.Salience/OpenSession",
            request_serializer=pb.OpenSessionRequest.SerializeToString,
            response_deserializer=pb.OpenSessionResponse.FromString,
        )
        sid = open_session(pb.OpenSessionRequest(), timeout=10).session_id  # still serving
        generate = channel.unary_stream(
            "/salience.v1.Salience/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateEvent.FromString,
        )
        events = list(
            generate(
                pb.GenerateRequest(session_id=sid, append_tokens=[1, 2], offset=0, max_tokens=3), timeout=30
            )
        )
        assert sum(e.HasField("token") and not e.token.is_prefill for e in events) == 3


def test_evergreen_stream_message_that_does_not_parse_gets_invalid_argument(servers: Servers) -> None:
    """reliability-findings.md: a bidi Session message that does not parse ended the stream with
    grpc's UNKNOWN; now INVALID_ARGUMENT naming the method, and the next session works."""
    from tokenwire.protocols.evergreen.client import EvergreenSession

    method = "/evergreen.v2.EvergreenService/StartSession"
    with grpc.insecure_channel(servers.url("grpc")) as channel:
        call = channel.stream_stream(method)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([b"\xff\xff\xff\x07garbage"]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert method in caught.value.details() and "not a valid message" in caught.value.details()

    async def detokenize() -> str:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            return await session.detokenize([1, 2, 3])

    assert isinstance(asyncio.run(asyncio.wait_for(detokenize(), 30)), str)


def test_evergreen_detokenize_of_deep_json_is_invalid_argument(servers: Servers) -> None:
    """reliability-findings.md: DETOKENIZE of an array nested 100k deep ended INTERNAL
    (RecursionError); now INVALID_ARGUMENT naming the action, and the next request works."""
    from tokenwire.protocols.evergreen.client import EvergreenError, EvergreenSession

    async def run() -> tuple[str, str]:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            node = session.data(("[" * 100_000 + "]" * 100_000).encode(), "application/json")
            try:
                await session.action("DETOKENIZE", {"tokens": node}, ["text"])["text"].text()
                return "ok", ""
            except EvergreenError as exc:
                failed = exc
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            return f"{failed.code} {failed.details}", await session.detokenize([1, 2, 3])

    error, text = asyncio.run(asyncio.wait_for(run(), 30))
    assert error.startswith("INVALID_ARGUMENT") and "nested too deeply" in error, error
    assert isinstance(text, str)
