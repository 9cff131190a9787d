"""A node's effective content: its leaves' chunks in depth-first order, as far as it is known.

Late binding makes the content of an action's input grow as fragments arrive: flattening
stops at the first child not received yet, the first missing fragment, or an inner node
that may still get more children. What comes before that point never changes, so an
action can start on it (the seed's streamed chains).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.nodes import NodeStore


@dataclass
class Ref:
    uri: str


@dataclass
class LeafView:
    id: str
    mimetype: str
    role: str
    original_file_name: str
    parts: list[bytes | Ref]  # payloads of the contiguous fragments, seq order
    complete: bool
    produced_by: str | None = None  # the action name for server outputs
    token_ids: list[int] = field(default_factory=list)

    @property
    def data(self) -> bytes:
        return b"".join(p for p in self.parts if isinstance(p, bytes))


@dataclass
class Flattened:
    leaves: list[LeafView]
    complete: bool
    waiting_for: str | None  # the node the content waits on when incomplete


def flatten(store: NodeStore, root: str) -> Flattened:
    leaves: list[LeafView] = []
    waiting: list[str] = []

    def visit(nid: str) -> bool:
        if nid in store.dropped:
            raise SessionAbort(grpc.StatusCode.NOT_FOUND, f"node {nid!r} was dropped but is still used")
        node = store.nodes.get(nid)
        if node is None or node.contiguous == 0:
            waiting.append(nid)
            return False
        if node.kind == "leaf":
            meta = node.metadata
            parts: list[bytes | Ref] = []
            for seq in range(node.contiguous):
                chunk = node.fragments[seq].chunk_fragment
                which = chunk.WhichOneof("payload")
                if which == "ref":
                    parts.append(Ref(chunk.ref))
                elif which == "data":
                    parts.append(bytes(chunk.data))
            leaves.append(
                LeafView(
                    nid,
                    meta.mimetype if meta is not None else "",
                    meta.role if meta is not None else "",
                    meta.original_file_name if meta is not None else "",
                    parts,
                    node.complete,
                    node.produced_by,
                    list(node.token_ids),
                )
            )
            if not node.complete:
                waiting.append(nid)
            return node.complete
        for child in node.children():
            if not visit(child):
                return False
        if not node.complete:
            waiting.append(nid)
            return False
        return True

    done = visit(root)
    return Flattened(leaves, done, None if done else waiting[0])
