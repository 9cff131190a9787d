from __future__ import annotations

import argparse
import asyncio
import queue
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc
from tokenwire.protocols.evergreen.servicer import add_to_server as SERVICE
from tokenwire.protocols.grpc_server import GrpcServer


class ServerThread:
    """The shared gRPC server with Evergreen only, on its own event loop in a thread."""

    def __init__(self, engine: Any, args: argparse.Namespace) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="evergreen-test", daemon=True)
        self.thread.start()
        self.server = self.call(GrpcServer(engine, args, "127.0.0.1", 0, services=[SERVICE]).start())

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.call(self.server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def ref_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evergreen_refs")
    (root / "path/to/file").mkdir(parents=True)
    (root / "path/to/file/part1").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 40)
    (root / "path/to/file/part2").write_bytes(bytes(range(256)) * 24)
    (root / "notes.txt").write_text("The quick brown fox jumps over the lazy dog.")
    return root


@pytest.fixture(scope="session")
def evergreen_server(smollm2_engine, ref_root: Path):
    args = argparse.Namespace(
        allow_ref_root=[str(ref_root)],
        evergreen_max_depth=8,
        evergreen_max_nodes=200,
        evergreen_max_tokens=12,
    )
    server = ServerThread(smollm2_engine, args)
    yield server
    server.stop()


class Conversation:
    """A live StartSession call driven message by message (sync gRPC client)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = spb_grpc.EvergreenServiceStub(self.channel)
        self.requests: queue.Queue[spb.SessionMessage | None] = queue.Queue()
        self.responses = self.stub.StartSession(iter(self.requests.get, None), timeout=120)
        self.received: list[pb.NodeFragment] = []

    def send(self, **kw: Any) -> None:
        self.requests.put(spb.SessionMessage(**kw))

    def fragments(self) -> Iterator[pb.NodeFragment]:
        for message in self.responses:
            for fragment in message.node_fragments:
                self.received.append(fragment)
                yield fragment

    def read_until_final(self, node_id: str) -> list[pb.NodeFragment]:
        out = []
        for fragment in self.fragments():
            if fragment.id == node_id:
                out.append(fragment)
                if not fragment.continued:
                    return out
        raise AssertionError(f"stream ended before {node_id} was final")

    def close(self) -> list[pb.NodeFragment]:
        """Half-close; returns what arrives until the RPC ends (raises on a non-OK status)."""
        self.requests.put(None)
        rest = list(self.fragments())
        self.channel.close()
        return rest

    def abort_status(self) -> grpc.RpcError:
        self.requests.put(None)
        try:
            for _ in self.fragments():
                pass
        except grpc.RpcError as exc:
            self.channel.close()
            return exc
        self.channel.close()
        raise AssertionError("the session ended without an error status")


@pytest.fixture
def conversation(evergreen_server):
    conversations: list[Conversation] = []

    def start() -> Conversation:
        c = Conversation(evergreen_server.target)
        conversations.append(c)
        return c

    yield start
    for c in conversations:
        c.requests.put(None)
        c.channel.close()


def text_of(fragments: list[pb.NodeFragment]) -> str:
    return b"".join(f.chunk_fragment.data for f in fragments).decode()


def check_output_stream(fragments: list[pb.NodeFragment], node_id: str) -> None:
    """The server's output rules: seq 0.. in order, metadata text/plain on seq 0 only,
    continued on all but the last."""
    assert [f.seq for f in fragments] == list(range(len(fragments)))
    assert all(f.id == node_id for f in fragments)
    assert fragments[0].chunk_fragment.metadata.mimetype == "text/plain"
    assert all(not f.chunk_fragment.HasField("metadata") for f in fragments[1:])
    assert all(f.continued for f in fragments[:-1]) and not fragments[-1].continued
