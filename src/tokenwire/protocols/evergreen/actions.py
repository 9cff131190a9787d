"""Action validation: names, parameters and configs (google.protobuf.Any) of every action.

| action | inputs | outputs | configs |
| GENERATE | exactly one, any name (`prompt`, `text`, ...) | `response`, `text` (text/plain),
  `logprobs` (application/json) | GenerateConfig, ConstraintConfig |
| SCORE | `continuation` (required), `prompt` (optional) | `score` (application/json) | - |
| TOKENIZE | exactly one | `tokens` (application/json) | - |
| DETOKENIZE | exactly one (a JSON array of ids) | `text` (text/plain) | - |
| COUNT_TOKENS | exactly one | `count` (application/json) | - |
| DROP | one or more nodes, any names | - | - |
| SET_TTL | one or more nodes, any names | - | TtlConfig |
| CANCEL | `action`: an output id of the action to cancel | - | - |
| SET_SESSION_OPTIONS | - | - | SessionOptions |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message

from tokenwire.protocols.evergreen.errors import SessionAbort, invalid
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb

CONFIG_TYPES: dict[str, type[Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (twpb.GenerateConfig, twpb.ConstraintConfig, twpb.TtlConfig, twpb.SessionOptions)
}
ANY_INPUT = "*"  # "exactly one input, any name"


@dataclass(frozen=True)
class ActionSchema:
    inputs: tuple[str, ...]  # allowed names; (ANY_INPUT,) = exactly one of any name
    required_inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    configs: tuple[type[Message], ...] = ()
    any_inputs: bool = False  # one or more inputs of any name (DROP, SET_TTL)
    required_configs: tuple[type[Message], ...] = ()


SCHEMAS: dict[str, ActionSchema] = {
    "GENERATE": ActionSchema(
        (ANY_INPUT,), (), ("response", "text", "logprobs"), (twpb.GenerateConfig, twpb.ConstraintConfig)
    ),
    "SCORE": ActionSchema(("prompt", "continuation"), ("continuation",), ("score",)),
    "TOKENIZE": ActionSchema((ANY_INPUT,), (), ("tokens",)),
    "DETOKENIZE": ActionSchema((ANY_INPUT,), (), ("text",)),
    "COUNT_TOKENS": ActionSchema((ANY_INPUT,), (), ("count",)),
    "DROP": ActionSchema((), (), (), any_inputs=True),
    "SET_TTL": ActionSchema(
        (), (), (), (twpb.TtlConfig,), any_inputs=True, required_configs=(twpb.TtlConfig,)
    ),
    "CANCEL": ActionSchema(("action",), ("action",), ()),
    "SET_SESSION_OPTIONS": ActionSchema(
        (), (), (), (twpb.SessionOptions,), required_configs=(twpb.SessionOptions,)
    ),
}
CONTROL_ACTIONS = {"DROP", "SET_TTL", "CANCEL", "SET_SESSION_OPTIONS"}


@dataclass
class ActionSpec:
    """A validated action: what the executor needs, with configs unpacked."""

    name: str
    label: str  # how messages name it: `GENERATE -> response_1`
    inputs: dict[str, str]
    outputs: dict[str, str]
    configs: dict[type[Message], Message] = field(default_factory=dict)
    target: str = ""

    def config(self, cls: type[Message]) -> Message | None:
        return self.configs.get(cls)

    @property
    def single_input(self) -> str:
        return next(iter(self.inputs.values()))


def _label(action: pb.Action) -> str:
    outs = ", ".join(p.id for p in action.outputs)
    ins = ", ".join(p.id for p in action.inputs)
    return f"{action.name or '(unnamed)'}({ins})" + (f" -> {outs}" if outs else "")


def _params(label: str, kind: str, params: list[pb.NamedParameter]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in params:
        if not p.id:
            raise invalid(f"action {label}: {kind} parameter {p.name!r} has no node id")
        if p.name in out:
            raise invalid(
                f"action {label}: {kind} parameter name {p.name!r} used twice (each name once per action)"
            )
        out[p.name] = p.id
    return out


def unpack_config(label: str, packed: any_pb2.Any) -> Message:
    type_name = packed.type_url.rsplit("/", 1)[-1]
    cls = CONFIG_TYPES.get(type_name)
    if cls is None:
        raise invalid(f"action {label}: unknown config type {packed.type_url!r}")
    message = cls()
    try:
        message.ParseFromString(packed.value)
    except DecodeError as exc:
        raise invalid(f"action {label}: config {type_name} does not parse: {exc}") from exc
    return message


def validate(action: pb.Action, model_names: set[str]) -> ActionSpec:
    label = _label(action)
    schema = SCHEMAS.get(action.name)
    if schema is None:
        raise SessionAbort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"action {label}: unknown action {action.name!r} (supported: {', '.join(SCHEMAS)})",
        )
    inputs = _params(label, "input", list(action.inputs))
    outputs = _params(label, "output", list(action.outputs))
    if schema.inputs == (ANY_INPUT,):
        if len(inputs) != 1:
            raise invalid(f"action {label}: {action.name} takes exactly one input, got {len(inputs)}")
    elif schema.any_inputs:
        if not inputs:
            raise invalid(f"action {label}: {action.name} needs at least one input node")
    else:
        for name in inputs:
            if name not in schema.inputs:
                raise invalid(
                    f"action {label}: unknown input name {name!r} (expected {', '.join(schema.inputs)})"
                )
        for name in schema.required_inputs:
            if name not in inputs:
                raise invalid(f"action {label}: missing input {name!r}")
    for name in outputs:
        if name not in schema.outputs:
            allowed = ", ".join(schema.outputs) or "none"
            raise invalid(f"action {label}: unknown output name {name!r} (expected {allowed})")
    if len(set(outputs.values())) != len(outputs):
        raise invalid(f"action {label}: one output id is given to two outputs (output ids must be new)")
    configs: dict[type[Message], Message] = {}
    for packed in action.configs:
        message = unpack_config(label, packed)
        if type(message) not in schema.configs:
            raise invalid(
                f"action {label}: config {message.DESCRIPTOR.full_name} does not apply to {action.name}"
            )
        if type(message) in configs:
            raise invalid(f"action {label}: config {message.DESCRIPTOR.full_name} given twice")
        configs[type(message)] = message
    for cls in schema.required_configs:
        if cls not in configs:
            raise invalid(f"action {label}: {action.name} needs a {cls.DESCRIPTOR.full_name} config")
    target = action.target_spec.id if action.HasField("target_spec") else ""
    if target and target not in model_names:
        raise SessionAbort(
            grpc.StatusCode.NOT_FOUND,
            f"action {label}: target {target!r} not found (this server runs {', '.join(sorted(model_names))})",  # noqa: E501
        )
    return ActionSpec(action.name, label, inputs, outputs, configs, target)
