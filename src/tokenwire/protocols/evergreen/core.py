"""The sans-IO Evergreen session: parsed SessionMessages in, effects and outgoing fragments out.

`SessionCore.receive(message, now)` stores node fragments (nodes.py rules), validates and
registers actions (actions.py) and applies the control actions (DROP, SET_TTL, CANCEL,
SET_SESSION_OPTIONS). It returns `Effects`: actions to start, actions to cancel, nodes
dropped. Whatever runs actions reads their inputs with `input()` (flatten.py) and writes
outputs with `emit()` / `finish()` / `fail()`, which return the NodeFragments to send.
Every rule broken raises SessionAbort; nothing here does IO or knows about time except the
`now` it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from tokenwire.engine.request import InvalidValueError, require_number
from tokenwire.protocols.evergreen.actions import CONTROL_ACTIONS, ActionSpec, validate
from tokenwire.protocols.evergreen.errors import SessionAbort, exhausted, invalid
from tokenwire.protocols.evergreen.flatten import Flattened, flatten
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb
from tokenwire.protocols.evergreen.nodes import Node, NodeStore, SessionLimits

ERROR_MIMETYPE = "application/x-protobuf; type=tokenwire.evergreen.v1.ActionError"


@dataclass(eq=False)
class ActionState:
    index: int
    spec: ActionSpec
    outputs: dict[str, Node]  # output name -> the node the server writes
    state: str = "running"  # running | done | failed | cancelled

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass
class Effects:
    start: list[ActionState] = field(default_factory=list)
    cancel: list[ActionState] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    changed: bool = False  # some node gained content: running actions may read more input
    out: list[pb.NodeFragment] = field(default_factory=list)  # fragments to send now


class SessionCore:
    def __init__(self, model_names: set[str], limits: SessionLimits | None = None) -> None:
        self.model_names = model_names
        self.store = NodeStore(limits)
        self.actions: list[ActionState] = []
        self.by_output: dict[str, ActionState] = {}
        self.partial_failures = False
        self.ttl_deadlines: dict[str, float] = {}

    # ------------------------------------------------------------------ intake
    def receive(self, message: spb.SessionMessage, now: float = 0.0) -> Effects:
        effects = Effects()
        for fragment in message.node_fragments:
            if self.store.add(fragment):
                effects.changed = True
        for action in message.actions:
            self._action(action, now, effects)
        return effects

    def _action(self, action: pb.Action, now: float, effects: Effects) -> None:
        spec = validate(action, self.model_names)
        if len(self.actions) >= self.store.limits.max_actions:
            raise exhausted(
                f"action {spec.label}: session action limit "
                f"max_actions={self.store.limits.max_actions} reached"
            )
        for nid in spec.inputs.values():
            if nid in self.store.dropped:
                raise SessionAbort(
                    grpc.StatusCode.NOT_FOUND, f"action {spec.label}: input node {nid!r} was dropped"
                )
        if spec.name in CONTROL_ACTIONS:
            self._control(spec, now, effects)
            return
        outputs = {name: self.store.reserve_output(nid, spec.name) for name, nid in spec.outputs.items()}
        state = ActionState(len(self.actions), spec, outputs)
        self.actions.append(state)
        for node in outputs.values():
            self.by_output[node.id] = state
        effects.start.append(state)

    def _control(self, spec: ActionSpec, now: float, effects: Effects) -> None:
        if spec.name == "SET_SESSION_OPTIONS":
            options = spec.config(twpb.SessionOptions)
            assert isinstance(options, twpb.SessionOptions)
            self.partial_failures = options.partial_failures
        elif spec.name == "CANCEL":
            target = self.by_output.get(spec.inputs["action"])
            if target is None:
                raise SessionAbort(
                    grpc.StatusCode.NOT_FOUND,
                    f"action {spec.label}: no action has output {spec.inputs['action']!r} "
                    "(CANCEL names an action by an output id)",
                )
            if target.running:
                target.state = "cancelled"
                effects.cancel.append(target)
                effects.out += self._finalize(target)
        elif spec.name == "DROP":
            for nid in spec.inputs.values():
                self._require_node(spec, nid)
                self._drop(nid, effects)
        elif spec.name == "SET_TTL":
            ttl = spec.config(twpb.TtlConfig)
            assert isinstance(ttl, twpb.TtlConfig)
            try:  # the engine's rule: a finite number (NaN and infinity are neither > 0 nor a TTL)
                require_number(ttl.ttl_seconds, "ttl_seconds")
            except InvalidValueError as exc:
                raise invalid(f"action {spec.label}: {exc}") from None
            if not ttl.ttl_seconds > 0:
                raise invalid(f"action {spec.label}: ttl_seconds must be > 0, got {ttl.ttl_seconds}")
            for nid in spec.inputs.values():
                self._require_node(spec, nid)
                self.ttl_deadlines[nid] = now + ttl.ttl_seconds

    def _require_node(self, spec: ActionSpec, nid: str) -> None:
        if nid not in self.store.nodes:
            raise SessionAbort(grpc.StatusCode.NOT_FOUND, f"action {spec.label}: node {nid!r} does not exist")

    def _drop(self, nid: str, effects: Effects) -> None:
        owner = self.by_output.get(nid)
        if owner is not None and owner.running:
            owner.state = "cancelled"  # nobody can read the output any more
            effects.cancel.append(owner)
        if self.store.drop(nid) is not None:
            effects.dropped.append(nid)
        self.ttl_deadlines.pop(nid, None)

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float | None:
        return min(self.ttl_deadlines.values(), default=None)

    def expire(self, now: float) -> Effects:
        """Drop the nodes whose TTL passed, with their descendants."""
        effects = Effects()
        for nid, deadline in list(self.ttl_deadlines.items()):
            if deadline <= now and nid in self.store.nodes:
                for victim in self.store.descendants(nid):
                    if victim in self.store.nodes:
                        self._drop(victim, effects)
            if deadline <= now:
                self.ttl_deadlines.pop(nid, None)
        return effects

    # ------------------------------------------------------------------ action side
    def input(self, action: ActionState, name: str | None = None) -> Flattened:
        nid = action.spec.inputs[name] if name is not None else action.spec.single_input
        return flatten(self.store, nid)

    def emit(
        self,
        action: ActionState,
        name: str,
        data: bytes,
        token_ids: list[int] | tuple[int, ...] = (),
        *,
        final: bool = False,
        mimetype: str = "text/plain",
    ) -> pb.NodeFragment | None:
        """The next fragment of an output node, recorded in the store (later actions read it)."""
        node = action.outputs.get(name)
        if node is None or not action.running or node.id not in self.store.nodes or node.complete:
            return None
        seq = node.contiguous
        fragment = pb.NodeFragment(id=node.id, seq=seq, continued=not final)
        fragment.chunk_fragment.data = data
        if seq == 0:
            fragment.chunk_fragment.metadata.mimetype = mimetype
        self.store.add_output(node, fragment, list(token_ids))
        return fragment

    def _finalize(self, action: ActionState, mimetype: str = "text/plain") -> list[pb.NodeFragment]:
        out = []
        for node in action.outputs.values():
            if node.id in self.store.nodes and not node.complete:
                seq = node.contiguous
                chunk = pb.Chunk(data=b"")
                if seq == 0:
                    chunk.metadata.mimetype = mimetype
                fragment = pb.NodeFragment(id=node.id, seq=seq, continued=False, chunk_fragment=chunk)
                self.store.add_output(node, fragment, [])
                out.append(fragment)
        return out

    def finish(self, action: ActionState) -> list[pb.NodeFragment]:
        """Close every output the action left open; the action is done."""
        if not action.running:
            return []
        out = self._finalize(action)
        action.state = "done"
        return out

    def fail(self, action: ActionState, error: SessionAbort) -> list[pb.NodeFragment]:
        """An action failed: abort the session, or with partial failures on, report the error
        as the final chunk of each output node (metadata ERROR_MIMETYPE, an ActionError)."""
        if not self.partial_failures:
            message = (
                error.message
                if action.spec.label in error.message
                else f"action {action.spec.label}: {error.message}"
            )
            raise SessionAbort(error.code, message)
        if not action.running:
            return []
        out = []
        for node in action.outputs.values():
            if node.id not in self.store.nodes or node.complete:
                continue
            payload = twpb.ActionError(
                action=action.spec.name,
                output_id=node.id,
                code=error.code.value[0],
                code_name=error.code.name,
                message=error.message,
            ).SerializeToString()
            chunk = pb.Chunk(data=payload)
            chunk.metadata.mimetype = ERROR_MIMETYPE  # also past seq 0: see docs/evergreen.md
            fragment = pb.NodeFragment(id=node.id, seq=node.contiguous, continued=False, chunk_fragment=chunk)
            self.store.add_output(node, fragment, [])
            out.append(fragment)
        action.state = "failed"
        return out
