"""Plain-value builders for Evergreen messages (tests of the sans-IO core)."""

from __future__ import annotations

from google.protobuf import any_pb2
from google.protobuf.message import Message

from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb

EOT = "application/x-protobuf; type=EndOfTurn"


def leaf(
    nid: str,
    data: bytes | str = b"",
    *,
    seq: int = 0,
    continued: bool = False,
    mimetype: str | None = "text/plain",
    role: str = "",
    ref: str | None = None,
) -> pb.NodeFragment:
    chunk = pb.Chunk()
    if ref is not None:
        chunk.ref = ref
    else:
        chunk.data = data.encode() if isinstance(data, str) else data
    if mimetype is not None:
        chunk.metadata.mimetype = mimetype
        if role:
            chunk.metadata.role = role
    return pb.NodeFragment(id=nid, seq=seq, continued=continued, chunk_fragment=chunk)


def inner(nid: str, *children: str, seq: int = 0, continued: bool = False) -> pb.NodeFragment:
    return pb.NodeFragment(id=nid, seq=seq, continued=continued, child_ids=list(children))


def action(
    name: str,
    inputs: dict[str, str] | None = None,
    outputs: dict[str, str] | None = None,
    configs: list[Message] = (),
    target: str | None = None,
) -> pb.Action:
    a = pb.Action(
        name=name,
        inputs=[pb.NamedParameter(name=k, id=v) for k, v in (inputs or {}).items()],
        outputs=[pb.NamedParameter(name=k, id=v) for k, v in (outputs or {}).items()],
    )
    for config in configs:
        packed = any_pb2.Any()
        packed.Pack(config)
        a.configs.append(packed)
    if target is not None:
        a.target_spec.id = target
    return a


def message(*items: pb.NodeFragment | pb.Action) -> spb.SessionMessage:
    return spb.SessionMessage(
        node_fragments=[i for i in items if isinstance(i, pb.NodeFragment)],
        actions=[i for i in items if isinstance(i, pb.Action)],
    )
