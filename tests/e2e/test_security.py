"""One `tokenwire serve` with $TOKENWIRE_AUTH_TOKEN and --tls-cert/--tls-key: every protocol
refuses a missing or wrong token in its own form and serves the right one over TLS, with the
stock clients; health, readiness, reflection and metrics stay open (docs/limits.md)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.serve_process import kill_if_running, stop_cleanly, wait_ready
from tokenwire.bench.inprocess import free_ports

TOKEN = "s3cret-token"


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(directory)
    ports = dict(zip(["lmtp", "grpc", "graphpipe", "aici", "http", "metrics"], free_ports(6), strict=True))
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tokenwire.cli", "serve", "--kv-cache-mb", "64",
            "--tls-cert", str(cert), "--tls-key", str(key),
            "--lmtp-port", str(ports["lmtp"]), "--grpc-port", str(ports["grpc"]),
            "--graphpipe-port", str(ports["graphpipe"]), "--aici", "--aici-port", str(ports["aici"]),
            "--aici-store-dir", str(directory / "aici"),
            "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TOKENWIRE_AUTH_TOKEN": TOKEN},
    )  # fmt: skip
    try:
        wait_ready(proc)
        context = ssl.create_default_context(cafile=str(cert))
        yield {"ports": ports, "ssl": context, "cert": cert.read_bytes(), "proc": proc}
        if proc.poll() is None:
            stop_cleanly(proc)
    finally:
        kill_if_running(proc)


def _https(server, port: str, path: str, token: str | None = None, body: bytes | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    url = f"https://127.0.0.1:{server['ports'][port]}{path}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=server["ssl"]) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------- LMTP


def test_lmtp_handshake_needs_the_token(server) -> None:
    from tokenwire.lmtp import Client

    url = f"wss://127.0.0.1:{server['ports']['lmtp']}/"

    async def attempt(token: str | None, query: str = "") -> object:
        try:
            async with await Client.connect(
                url + query, auth_token=token, ssl_context=server["ssl"], extensions=["text"]
            ) as c:
                return await c.complete("The capital of France is", max_tokens=3)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status

    assert asyncio.run(attempt(None)) == 401
    assert asyncio.run(attempt("wrong")) == 401
    assert asyncio.run(attempt(None, "?token=wrong")) == 401
    by_header = asyncio.run(attempt(TOKEN))
    assert isinstance(by_header, str) and by_header, by_header
    assert asyncio.run(attempt(None, f"?token={TOKEN}")) == by_header  # greedy: the same text


# ---------------------------------------------------------------- gRPC: Salience and Evergreen


def test_salience_needs_the_token(server) -> None:
    from tokenwire.protocols.salience.client import AsyncClient, SalienceError

    target = f"127.0.0.1:{server['ports']['grpc']}"

    async def open_session(token: str | None) -> str:
        client = AsyncClient(target, auth_token=token, tls=True, root_certificates=server["cert"])
        try:
            session = await client.open()
            return "ok" if session else "?"
        except SalienceError as exc:
            return str(exc)
        finally:
            await client.channel.close()

    for token in (None, "wrong"):
        assert "UNAUTHENTICATED" in asyncio.run(open_session(token)).upper()
    assert asyncio.run(open_session(TOKEN)) == "ok"


def test_evergreen_needs_the_token(server) -> None:
    from tokenwire.protocols.evergreen.client import Chat, EvergreenError, EvergreenSession, GenerateConfig

    target = f"127.0.0.1:{server['ports']['grpc']}"

    async def say(token: str | None) -> str:
        session = await EvergreenSession.connect(target, auth_token=token, root_certificates=server["cert"])
        try:
            chat = Chat(session, None, "")
            return "".join([t async for t in chat.say("Hi", GenerateConfig(max_tokens=3, temperature=0.0))])
        except EvergreenError as exc:
            return f"error {exc.code}"
        finally:
            await session.close()

    for token in (None, "wrong"):
        assert asyncio.run(asyncio.wait_for(say(token), 60)) == "error UNAUTHENTICATED"
    answer = asyncio.run(asyncio.wait_for(say(TOKEN), 60))
    assert answer and not answer.startswith("error"), answer


def test_grpc_health_and_reflection_stay_open(server) -> None:
    credentials = grpc.ssl_channel_credentials(server["cert"])
    with grpc.secure_channel(f"127.0.0.1:{server['ports']['grpc']}", credentials) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
        assert "salience.v1.Salience" in {s.name for s in reply.list_services_response.service}
    with grpc.insecure_channel(f"127.0.0.1:{server['ports']['grpc']}") as channel:  # TLS only
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


# ---------------------------------------------------------------- GraphPipe


def test_graphpipe_needs_the_token(server) -> None:
    from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError

    url = f"https://127.0.0.1:{server['ports']['graphpipe']}/"
    for token in (None, "wrong"):
        with Client(url, auth_token=token, ssl_context=server["ssl"]) as client:
            with pytest.raises(GraphPipeClientError) as caught:
                client.metadata()
        assert caught.value.code == 11 and caught.value.status == 401, caught.value
        assert "bearer token" in str(caught.value)
    with Client(url, auth_token=TOKEN, ssl_context=server["ssl"]) as client:
        assert client.metadata().inputs
    assert _https(server, "graphpipe", "/control/is_ready") == (200, b"ok\n")
    assert _https(server, "graphpipe", "/")[0] == 401  # the metadata page is not a probe


# ---------------------------------------------------------------- AICI REST


def test_aici_rest_needs_the_token(server) -> None:
    body = json.dumps({"controller": "regex", "controller_arg": "ok"}).encode()
    for token in (None, "wrong"):
        status, raw = _https(server, "aici", "/v1/run", token, body)
        assert status == 401 and "bearer token" in json.loads(raw)["error"], raw
    status, raw = _https(server, "aici", "/v1/run", TOKEN, body)
    assert status == 200, raw
    events = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x and x != "data: [DONE]"]
    assert "".join(f["text"] for e in events[1:] for f in e["forks"]) == "ok"


# ---------------------------------------------------------------- OpenAI HTTP API and metrics


def test_openai_api_needs_the_token(server) -> None:
    base = f"https://127.0.0.1:{server['ports']['http']}/v1"
    http_client = openai.DefaultHttpx2Client(verify=server["ssl"])
    try:
        client = openai.OpenAI(base_url=base, api_key="wrong", http_client=http_client, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        client = openai.OpenAI(base_url=base, api_key=TOKEN, http_client=http_client, max_retries=0)
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    finally:
        http_client.close()
    status, raw = _https(server, "http", "/v1/models")  # no token at all
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error", raw
    assert _https(server, "http", "/health")[0] == 200
    status, raw = _https(server, "metrics", "/metrics")
    assert status == 200 and b"tokenwire" in raw


def test_refusals_are_logged_without_the_token(server) -> None:
    """Runs last: each refusal above left a warning naming its protocol, never the token; then
    the server stops cleanly."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0 and "stopped" in log, log
    refusals = [line for line in log.splitlines() if "refused" in line]
    for protocol in ("lmtp", "grpc", "graphpipe", "aici", "openai"):
        assert any(f"{protocol}: refused" in line for line in refusals), (protocol, refusals)
    assert any("wrong token" in line for line in refusals) and any("no token" in line for line in refusals)
    assert TOKEN not in log
