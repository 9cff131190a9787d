"""The node store of one session: fragments keyed by (id, seq), the DAG they form, and limits.

Rules enforced here (each violation aborts the session naming the node and the rule):
the first fragment for an (id, seq) wins and duplicates are ignored; no seq past the node's
final one (the fragment with continued=false); metadata only on seq 0 (a later fragment may
repeat seq 0's metadata unchanged, as the seed's own first example does); child_ids and
chunk_fragment never both in one node; a leaf's seq 0 carries metadata; no cycles; nesting
depth, node count and bytes per session stay under the configured limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tokenwire.protocols.evergreen.errors import SessionAbort, exhausted, invalid
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb

DEFAULT_MAX_TOKENS = 256  # GENERATE's max_tokens when its GenerateConfig sets none


@dataclass
class SessionLimits:
    max_depth: int = 32  # edges on the longest parent -> child chain
    max_nodes: int = 10_000
    max_bytes: int = 64 * 2**20  # inline data, refs and child ids, plus generated output
    max_actions: int = 1_000
    # chunks one node flattens to, each shared node counted every time it is used (flatten.py)
    max_flattened_chunks: int = 100_000
    # child ids listed by all of a session's fragments: each new edge updates the nesting
    # heights above it, at most (max_depth + 1) times per edge over a session (see _raise)
    max_edges: int = 100_000


@dataclass(eq=False)
class Node:
    id: str
    fragments: dict[int, pb.NodeFragment] = field(default_factory=dict)
    final_seq: int | None = None
    kind: str | None = None  # "leaf" | "inner" once a fragment shows it
    produced_by: str | None = None  # the action name when the server writes this node
    token_ids: list[int] = field(default_factory=list)  # server outputs: the exact tokens
    contiguous: int = 0  # fragments 0 .. contiguous-1 are present
    nbytes: int = 0

    @property
    def complete(self) -> bool:
        return self.final_seq is not None and self.contiguous == self.final_seq + 1

    @property
    def metadata(self) -> pb.ChunkMetadata | None:
        first = self.fragments.get(0)
        if first is None or not first.HasField("chunk_fragment"):
            return None
        return first.chunk_fragment.metadata

    def children(self) -> list[str]:
        """child ids of the contiguous fragments, in seq order."""
        return [c for seq in range(self.contiguous) for c in self.fragments[seq].child_ids]

    def all_children(self) -> list[str]:
        return [c for f in self.fragments.values() for c in f.child_ids]


def _fragment_bytes(fragment: pb.NodeFragment) -> int:
    size = sum(len(c) for c in fragment.child_ids)
    if fragment.HasField("chunk_fragment"):
        chunk = fragment.chunk_fragment
        size += len(chunk.data) + len(chunk.ref)
    return size


class NodeStore:
    def __init__(self, limits: SessionLimits | None = None) -> None:
        self.limits = limits or SessionLimits()
        self.nodes: dict[str, Node] = {}
        self.dropped: set[str] = set()
        self.parents: dict[str, set[str]] = {}  # child id -> ids of nodes naming it
        # node id -> edges on the longest known downward chain from it (ids not yet arrived: 0);
        # kept as edges arrive, so an edge costs the heights it raises, not a walk of the graph
        self.height: dict[str, int] = {}
        self.child_refs = 0  # child ids listed so far (against max_edges)
        self.total_bytes = 0

    # ------------------------------------------------------------------ intake
    def add(self, fragment: pb.NodeFragment) -> bool:
        """Store a client fragment. Returns False for an ignored duplicate."""
        nid = fragment.id
        if not nid:
            raise invalid("node fragment without an id: every NodeFragment needs a node id")
        if nid in self.dropped:
            raise SessionAbort(
                grpc.StatusCode.NOT_FOUND, f"node {nid!r}: fragment for a node that was dropped"
            )
        node = self.nodes.get(nid)
        if node is not None and node.produced_by is not None:
            raise invalid(
                f"node {nid!r} is the output of a {node.produced_by} action: only the server writes it"
            )
        seq = fragment.seq
        if seq < 0:
            raise invalid(f"node {nid!r}: seq {seq} is negative")
        if node is not None and seq in node.fragments:
            return False  # the first fragment with this (id, seq) wins; retries are not errors
        has_chunk = fragment.HasField("chunk_fragment")
        if has_chunk and fragment.child_ids:
            raise invalid(
                f"node {nid!r} seq {seq}: a fragment cannot carry both child_ids and chunk_fragment"
            )
        if node is None:
            node = self._new_node(nid)
        self._check_final(node, fragment)
        self._check_kind(node, fragment)
        self._check_metadata(node, fragment)
        self._charge_edges(node, len(fragment.child_ids))
        self._charge(node, _fragment_bytes(fragment))
        node.fragments[seq] = fragment
        if not fragment.continued:
            node.final_seq = seq
        while node.contiguous in node.fragments:
            node.contiguous += 1
        for child in dict.fromkeys(fragment.child_ids):  # a child listed n times is one edge to check
            self._add_edge(node, child)
        return True

    def _new_node(self, nid: str) -> Node:
        if len(self.nodes) >= self.limits.max_nodes:
            raise exhausted(f"node {nid!r}: session node limit max_nodes={self.limits.max_nodes} reached")
        node = Node(nid)
        self.nodes[nid] = node
        return node

    def _charge(self, node: Node, size: int) -> None:
        if self.total_bytes + size > self.limits.max_bytes:
            raise exhausted(
                f"node {node.id!r}: session byte limit max_bytes={self.limits.max_bytes} exceeded"
            )
        self.total_bytes += size
        node.nbytes += size

    def _charge_edges(self, node: Node, count: int) -> None:
        # checked before any edge of the fragment is looked at: a 64 MiB session of 3-byte ids
        # is ~2*10^7 edges (hours of the former per-edge graph walks, see _add_edge)
        if self.child_refs + count > self.limits.max_edges:
            raise exhausted(
                f"node {node.id!r}: {self.child_refs + count} child ids in this session exceed the "
                f"limit max_edges={self.limits.max_edges} (--evergreen-max-edges)"
            )
        self.child_refs += count

    def _check_final(self, node: Node, fragment: pb.NodeFragment) -> None:
        seq = fragment.seq
        if node.final_seq is not None and seq > node.final_seq:
            raise invalid(
                f"node {node.id!r}: fragment seq {seq} is past the node's final seq {node.final_seq} "
                "(the fragment with continued=false)"
            )
        if not fragment.continued:
            later = [s for s in node.fragments if s > seq]
            if later:
                raise invalid(
                    f"node {node.id!r}: fragment seq {max(later)} is past the node's final seq {seq} "
                    "(the fragment with continued=false)"
                )

    def _check_kind(self, node: Node, fragment: pb.NodeFragment) -> None:
        kind = "leaf" if fragment.HasField("chunk_fragment") else "inner" if fragment.child_ids else None
        if kind is None:
            return
        if node.kind is not None and node.kind != kind:
            raise invalid(
                f"node {node.id!r}: child_ids and chunk_fragment are exclusive within a node "
                f"(seq {fragment.seq} makes a {kind} of a {node.kind} node)"
            )
        node.kind = kind

    def _check_metadata(self, node: Node, fragment: pb.NodeFragment) -> None:
        chunk = fragment.chunk_fragment if fragment.HasField("chunk_fragment") else None
        if fragment.seq == 0:
            if chunk is not None and not chunk.HasField("metadata"):
                raise invalid(f"node {node.id!r}: seq 0 of a leaf must carry the chunk metadata (mimetype)")
            for seq, other in node.fragments.items():
                self._same_metadata(node, seq, other, chunk)
        elif 0 in node.fragments:
            first = node.fragments[0]
            self._same_metadata(node, fragment.seq, fragment, first.chunk_fragment)

    @staticmethod
    def _same_metadata(node: Node, seq: int, fragment: pb.NodeFragment, first: pb.Chunk | None) -> None:
        if not fragment.HasField("chunk_fragment") or not fragment.chunk_fragment.HasField("metadata"):
            return
        if first is None or fragment.chunk_fragment.metadata != first.metadata:
            raise invalid(
                f"node {node.id!r}: metadata on seq {seq}: only seq 0 carries metadata "
                "(a later fragment may only repeat seq 0's metadata unchanged)"
            )

    # ------------------------------------------------------------------ DAG
    # Each distinct edge used to cost a walk of the graph (a cycle search below the child, the
    # depth above the parent, the height below the child): O(edges x nodes) a session, and
    # 12,400 edges in 32 layers already held the event loop for 15 s. Now the longest chain
    # below every node (`height`) is kept up to date as edges arrive: a new edge raises the
    # heights of its ancestors, each at most max_depth + 1 times before the limit refuses it,
    # so a session's edges cost O((max_depth + 1) x edges) in all. A cycle raises the heights
    # around it without end, so it meets the same limit; only then, once, is the graph walked
    # to tell a cycle from a chain that is too deep (the session ends either way).
    # A dropped node's height stays counted by its parents, which still name it.
    def _add_edge(self, parent: Node, child: str) -> None:
        if child in self.dropped:
            raise SessionAbort(grpc.StatusCode.NOT_FOUND, f"node {parent.id!r}: child {child!r} was dropped")
        if child == parent.id:
            raise self._cycle(parent.id, child)
        above = self.parents.setdefault(child, set())
        if parent.id in above:
            return  # already an edge (listed by an earlier fragment)
        above.add(parent.id)
        self._raise(parent.id, child, self.height.get(child, 0) + 1)

    def _raise(self, start: str, child: str, height: int) -> None:
        """Raise `start`'s height to `height` and its ancestors' to match; refuse past max_depth.
        Level by level: the parents of a level's raised nodes are gathered by C set unions, so
        Python touches each ancestor once a level, not once an edge (10 hubs under 9,900
        parents each, raised 31 times: 0.95 s a tuple per edge, see the test for this one)."""
        limit = self.limits.max_depth
        heights, parents = self.height, self.parents
        frontier: set[str] = {start}
        while frontier:
            raised = [nid for nid in frontier if heights.get(nid, 0) < height]
            if not raised:
                return
            if height > limit:
                if self._reaches(child, start):
                    raise self._cycle(start, child)
                raise exhausted(
                    f"node {start!r}: nesting depth over {limit} through child {child!r} exceeds "
                    f"the limit max_depth={limit}"
                )
            for nid in raised:
                heights[nid] = height
            frontier = set().union(*(parents.get(nid, ()) for nid in raised))
            height += 1

    @staticmethod
    def _cycle(parent: str, child: str) -> SessionAbort:
        return invalid(f"node {parent!r}: child {child!r} makes a cycle (nodes cannot contain themselves)")

    def _reaches(self, start: str, target: str) -> bool:
        seen: set[str] = set()
        stack = [start]
        while stack:
            nid = stack.pop()
            if nid == target:
                return True
            if nid in seen:
                continue
            seen.add(nid)
            node = self.nodes.get(nid)
            if node is not None:
                stack.extend(node.all_children())
        return False

    # ------------------------------------------------------------------ server outputs, drop
    def reserve_output(self, nid: str, action: str) -> Node:
        if nid in self.nodes or nid in self.dropped:
            raise invalid(f"action {action}: output id {nid!r} is not new (output node ids must be new)")
        node = self._new_node(nid)
        node.produced_by = action
        node.kind = "leaf"
        return node

    def add_output(self, node: Node, fragment: pb.NodeFragment, token_ids: list[int]) -> None:
        """Record a fragment the server sends for one of its output nodes."""
        self._charge(node, _fragment_bytes(fragment))
        node.fragments[fragment.seq] = fragment
        node.token_ids.extend(token_ids)
        if not fragment.continued:
            node.final_seq = fragment.seq
        while node.contiguous in node.fragments:
            node.contiguous += 1

    def drop(self, nid: str) -> Node | None:
        node = self.nodes.pop(nid, None)
        if node is None:
            return None
        self.dropped.add(nid)
        self.total_bytes -= node.nbytes
        return node

    def descendants(self, nid: str) -> list[str]:
        out: list[str] = []
        seen: set[str] = set()
        stack = [nid]
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            seen.add(cur)
            out.append(cur)
            node = self.nodes.get(cur)
            if node is not None:
                stack.extend(node.all_children())
        return out
