"""A client generated from our .proto at test time (protoc, in a fresh process with nothing of
tokenwire imported) talks to the live server; and the committed generated code is current."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.protocols.evergreen.test_server import greedy_text
from tokenwire.protocols import protogen

PROTO_DIR = Path(protogen.__file__).parent / "evergreen" / "proto"
GEN_DIR = PROTO_DIR.parent / "gen"

CLIENT = textwrap.dedent(
    """
    import sys
    import grpc
    import evergreen_pb2 as pb, evergreen_service_pb2 as spb, evergreen_service_pb2_grpc as rpc
    import tokenwire_evergreen_pb2 as tw
    from google.protobuf import any_pb2
    config = any_pb2.Any()
    config.Pack(tw.GenerateConfig(temperature=0, max_tokens=8))
    messages = [
        spb.SessionMessage(actions=[pb.Action(
            name="GENERATE", configs=[config],
            inputs=[pb.NamedParameter(name="prompt", id="p")],
            outputs=[pb.NamedParameter(name="response", id="r")])]),
        spb.SessionMessage(node_fragments=[pb.NodeFragment(id="p", chunk_fragment=pb.Chunk(
            metadata=pb.ChunkMetadata(mimetype="text/plain"), data=b"Hi"))]),
    ]
    with grpc.insecure_channel(sys.argv[1]) as channel:
        for reply in rpc.EvergreenServiceStub(channel).StartSession(iter(messages), timeout=60):
            for f in reply.node_fragments:
                sys.stdout.buffer.write(f.chunk_fragment.data)
    """
)


def test_protoc_generated_client_talks_to_the_server(tmp_path, evergreen_server, smollm2_engine):
    out = tmp_path / "gen"
    protogen.generate(PROTO_DIR, out)
    # protogen made the imports package-relative; a plain generated client uses them absolute
    for path in out.glob("*_pb2*.py"):
        path.write_text(path.read_text().replace("from . import ", "import ").replace("from .", "from "))
    (tmp_path / "client.py").write_text(CLIENT)
    result = subprocess.run(
        [sys.executable, "client.py", evergreen_server.target],
        cwd=tmp_path,
        env={"PYTHONPATH": str(out)},
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == greedy_text(smollm2_engine, "Hi")


def test_committed_generated_code_is_current(tmp_path):
    written = protogen.generate(PROTO_DIR, tmp_path)
    assert written
    for path in written:
        assert path.read_text() == (GEN_DIR / path.name).read_text(), f"stale {path.name}: run `make proto`"


def test_wire_numbers_match_the_published_schema():
    from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
    from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb

    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(spb.SessionMessage) == {"node_fragments": 1, "actions": 2}
    assert numbers(pb.NodeFragment) == {
        "id": 1,
        "seq": 2,
        "continued": 3,
        "child_ids": 4,
        "chunk_fragment": 5,
    }
    assert numbers(pb.Chunk) == {"metadata": 1, "ref": 3, "data": 10}
    assert numbers(pb.ChunkMetadata) == {
        "mimetype": 1,
        "role": 2,
        "original_file_name": 3,
        "capture_time": 6,
        "experimental": 100,
    }
    assert numbers(pb.Action) == {"name": 2, "inputs": 3, "outputs": 4, "configs": 5, "target_spec": 6}
    assert numbers(pb.NamedParameter) == {"name": 1, "id": 2} and numbers(pb.TargetSpec) == {"id": 1}
    assert pb.NodeFragment.DESCRIPTOR.fields_by_name["chunk_fragment"].has_presence
    service = spb.DESCRIPTOR.services_by_name["EvergreenService"]
    assert service.full_name == "evergreen.v2.EvergreenService"
    method = service.methods_by_name["StartSession"]
    assert method.client_streaming and method.server_streaming
