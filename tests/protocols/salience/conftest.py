from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from tokenwire.protocols.grpc_server import GrpcServer
from tokenwire.protocols.salience.service import add_to_server as SERVICE

HERE = Path(__file__).parent
SEED = HERE / "seed_001_salience.txt"  # the spec file exactly as it arrived (one line)
COMMITTED_PROTO = (
    Path(__file__).parents[3] / "src" / "tokenwire" / "protocols" / "salience" / "proto" / "salience.proto"
)


def without_whitespace(text: str) -> str:
    return re.sub(r"\s+", "", text)


class ServerThread:
    """The shared gRPC server with the Salience service, on its own event loop in a thread, so
    blocking stubs in the tests talk to it like any outside client."""

    def __init__(self, engine: Any, **args: Any) -> None:
        self.engine = engine
        namespace = argparse.Namespace(session_ttl=args.pop("session_ttl", 600.0), **args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="salience-test", daemon=True)
        self.thread.start()
        self.server: GrpcServer = self.call(
            GrpcServer(engine, namespace, "127.0.0.1", 0, services=[SERVICE]).start()
        )
        self.target = f"127.0.0.1:{self.server.port}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def seed_proto(tmp_path_factory) -> tuple[ModuleType, ModuleType]:
    """salience_pb2 / salience_pb2_grpc generated now from the seed's proto text, not ours.

    The seed arrived on one line (every `//` comment swallows the rest), so protoc needs the
    text re-broken into lines; the committed .proto is that text, and this checks it differs
    from the seed in whitespace only. The generated module is put in a private descriptor pool:
    the default pool already holds our committed `salience.v1` code, and one pool cannot hold
    the same symbols twice. The wire format does not depend on the pool.
    """
    seed, ours = SEED.read_text(), COMMITTED_PROTO.read_text()
    ours_body = ours.split("\n", 3)[3]  # our 3-line header says where the text comes from
    assert without_whitespace(seed) == without_whitespace(ours_body)
    out = tmp_path_factory.mktemp("seed_proto")
    (out / "seed_salience.proto").write_text(ours_body)
    from grpc_tools import protoc

    args = ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "seed_salience.proto"]
    assert protoc.main(args) == 0
    pb2 = out / "seed_salience_pb2.py"
    text = pb2.read_text()
    assert "_descriptor_pool.Default()" in text
    pb2.write_text(text.replace("_descriptor_pool.Default()", "_descriptor_pool.DescriptorPool()"))
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("seed_salience_pb2"), importlib.import_module("seed_salience_pb2_grpc")
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="session")
def pb(seed_proto) -> ModuleType:
    return seed_proto[0]


@pytest.fixture(scope="session")
def salience_server(smollm2_engine):
    server = ServerThread(smollm2_engine)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stub(salience_server, seed_proto):
    channel = grpc.insecure_channel(salience_server.target)
    yield seed_proto[1].SalienceStub(channel)
    channel.close()


@pytest.fixture
def open_session(stub, pb, smollm2_engine):
    """Opens sessions through the seed client and closes them after the test."""
    opened: list[str] = []

    def _open() -> str:
        sid = stub.OpenSession(pb.OpenSessionRequest(model="")).session_id
        opened.append(sid)
        return sid

    yield _open
    for sid in opened:
        smollm2_engine.close_session(sid)


def openssl_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost made with the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
