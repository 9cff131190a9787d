"""A node's effective content: its leaves' chunks in depth-first order, as far as it is known.

Late binding makes the content of an action's input grow as fragments arrive: flattening
stops at the first child not received yet, the first missing fragment, or an inner node
that may still get more children. What comes before that point never changes, so an
action can start on it (the seed's streamed chains).

A node graph can share subgraphs, so its flattened size can be exponential in its node count
(a chain of 30 diamonds flattens to 2^30 chunks). `flatten` first measures the expansion by
counting over the graph with one memo entry per node, O(nodes + edges), and refuses a node
whose flattened content would pass `max_flattened_chunks` or `max_bytes` before building any
of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tokenwire.protocols.evergreen.errors import SessionAbort, exhausted
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


@dataclass(frozen=True)
class Expansion:
    """What flattening a node would produce at most: its chunks and their inline bytes."""

    chunks: int
    nbytes: int


def expansion(store: NodeStore, root: str) -> Expansion:
    """The flattened size of `root` over every fragment received so far (an upper bound of what
    `flatten` builds now, which may stop early), without building it: each node is counted once
    and its total reused wherever it is shared. Missing or dropped nodes count as empty."""
    totals: dict[str, Expansion] = {}
    stack = [root]
    while stack:  # iterative post-order: the depth limit is a flag, the recursion limit is not
        nid = stack[-1]
        if nid in totals:
            stack.pop()
            continue
        node = store.nodes.get(nid)
        if node is None:
            totals[nid] = Expansion(0, 0)
            stack.pop()
        elif node.kind == "leaf":
            totals[nid] = Expansion(node.contiguous, node.nbytes)
            stack.pop()
        else:
            children = node.children()
            pending = [c for c in dict.fromkeys(children) if c not in totals]
            if pending:
                stack.extend(pending)  # acyclic (nodes.py refuses cycles): this ends
                continue
            totals[nid] = Expansion(
                sum(totals[c].chunks for c in children), sum(totals[c].nbytes for c in children)
            )
            stack.pop()
    return totals[root]


def check_expansion(store: NodeStore, root: str) -> Expansion:
    """RESOURCE_EXHAUSTED naming the limit and its flag when `root` flattens past a limit."""
    size = expansion(store, root)
    limits = store.limits
    if size.chunks > limits.max_flattened_chunks:
        raise exhausted(
            f"node {root!r} flattens to {size.chunks} chunks (shared nodes count each time they are "
            f"used), over the limit max_flattened_chunks={limits.max_flattened_chunks} "
            "(--evergreen-max-flattened-chunks)"
        )
    if size.nbytes > limits.max_bytes:
        raise exhausted(
            f"node {root!r} flattens to {size.nbytes} bytes (shared nodes count each time they are "
            f"used), over the session byte limit max_bytes={limits.max_bytes} (--evergreen-max-bytes)"
        )
    return size


def flatten(store: NodeStore, root: str) -> Flattened:
    check_expansion(store, root)
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
