"""GraphPipe messages <-> flatbuffer bytes (sans-IO; the schema is graphpipe.fbs).

Requests: `Request { req: Req }` with the union InferRequest (1) / MetadataRequest (2).
Responses carry no union: an InferRequest is answered with an InferResponse root, a
MetadataRequest with a MetadataResponse root. Encoders return a memoryview on the message's
buffer (the payload is copied into it once and not again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import flatbuffers
import numpy as np

from tokenwire.protocols.graphpipe.flatreader import CodecError, Table
from tokenwire.protocols.graphpipe.response_writer import encode_numeric_response
from tokenwire.protocols.graphpipe.tensor_codec import (
    DEFAULT_DATA_ALIGNMENT,
    add_string_vector,
    add_tensor_vector,
    decode_tensor,
    encoded_size,
    finish,
    new_builder,
)
from tokenwire.protocols.graphpipe.types import STRING_KINDS, Type

REQ_INFER, REQ_METADATA = 1, 2

__all__ = [
    "CodecError",
    "ErrorInfo",
    "IOMetadata",
    "InferRequest",
    "InferResponse",
    "MetadataRequest",
    "MetadataResponse",
    "build_infer_response",
    "decode_infer_response",
    "decode_metadata_response",
    "decode_request",
    "encode_infer_request",
    "encode_infer_response",
    "encode_metadata_request",
    "encode_metadata_response",
]


@dataclass
class InferRequest:
    inputs: list[np.ndarray]
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    config: bytes = b""


@dataclass
class MetadataRequest:
    pass


@dataclass
class ErrorInfo:
    code: int
    message: str


@dataclass
class InferResponse:
    outputs: list[np.ndarray] = field(default_factory=list)
    errors: list[ErrorInfo] = field(default_factory=list)


@dataclass
class IOMetadata:
    name: str
    type: Type
    shape: list[int]  # -1 = any size in that dimension
    description: str = ""


@dataclass
class MetadataResponse:
    name: str = ""
    version: str = ""
    server: str = ""
    description: str = ""
    inputs: list[IOMetadata] = field(default_factory=list)
    outputs: list[IOMetadata] = field(default_factory=list)


def _text(raw: bytes | None, what: str) -> str:
    if raw is None:
        return ""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CodecError(f"{what} is not valid UTF-8") from exc


# ------------------------------------------------------------------ requests
def decode_request(buf: bytes | bytearray | memoryview) -> InferRequest | MetadataRequest:
    """Parse a Request; input tensors are views on `buf` (keep it alive while they are used)."""
    try:
        root = Table.root(buf)
        kind = root.u8(0)
        body = root.table(1)
        if kind == REQ_METADATA:
            return MetadataRequest()
        if kind != REQ_INFER or body is None:
            raise CodecError(f"Request holds neither an InferRequest nor a MetadataRequest (req_type {kind})")
        names = [_text(s, "an input name") for s in body.strings(1)]
        tensors = body.tables(2)
        inputs = [
            decode_tensor(t, f"input {names[i]!r}" if i < len(names) else f"input tensor {i}")
            for i, t in enumerate(tensors)
        ]
        return InferRequest(
            inputs=inputs,
            input_names=names,
            output_names=[_text(s, "an output name") for s in body.strings(3)],
            config=body.string(0) or b"",
        )
    except CodecError:
        raise
    except (ValueError, IndexError, OverflowError) as exc:  # struct/numpy on garbage
        raise CodecError(f"undecodable request: {exc}") from exc


def encode_infer_request(req: InferRequest, *, data_alignment: int = DEFAULT_DATA_ALIGNMENT) -> memoryview:
    """Builder order as Oracle's client (config, tensors, names, table), so with
    data_alignment=1 the bytes equal what `graphpipe.convert.serialize_infer_request` makes."""
    size = 1024 + sum(encoded_size(np.asarray(a)) for a in req.inputs)
    size += sum(8 + len(s) for s in (*req.input_names, *req.output_names)) + len(req.config)
    b = new_builder(size)
    config = b.CreateString(req.config)
    tensors = add_tensor_vector(b, list(req.inputs), data_alignment)
    input_names = add_string_vector(b, list(req.input_names))
    output_names = add_string_vector(b, list(req.output_names))
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(0, config, 0)
    b.PrependUOffsetTRelativeSlot(2, tensors, 0)
    b.PrependUOffsetTRelativeSlot(1, input_names, 0)
    b.PrependUOffsetTRelativeSlot(3, output_names, 0)
    return _finish_request(b, REQ_INFER, b.EndObject())


def encode_metadata_request() -> memoryview:
    b = new_builder(64)
    b.StartObject(0)
    return _finish_request(b, REQ_METADATA, b.EndObject())


def _finish_request(b: flatbuffers.Builder, kind: int, body: int) -> memoryview:
    b.StartObject(2)
    b.PrependUint8Slot(0, kind, 0)
    b.PrependUOffsetTRelativeSlot(1, body, 0)
    return finish(b, b.EndObject())


# ------------------------------------------------------------------ responses
def encode_infer_response(
    outputs: list[np.ndarray] | None = None, errors: list[ErrorInfo] | None = None
) -> memoryview:
    """An InferResponse with outputs, or (the spec allows only one of the two) with errors.

    Numeric outputs (the hot path) go through the precomputed-layout writer; String tensors
    and errors through the generic flatbuffers Builder."""
    if errors:
        return build_infer_response(errors=errors)
    arrays = [np.asarray(a) for a in outputs or []]
    if any(a.dtype.kind in STRING_KINDS for a in arrays):
        return build_infer_response(arrays)
    return encode_numeric_response(arrays)


def build_infer_response(
    outputs: list[np.ndarray] | None = None,
    errors: list[ErrorInfo] | None = None,
    *,
    data_alignment: int = DEFAULT_DATA_ALIGNMENT,
) -> memoryview:
    """encode_infer_response on the generic Builder (any tensor type, errors)."""
    if errors:
        b = new_builder(256 + sum(64 + len(e.message.encode()) for e in errors))
        built = []
        for e in reversed(errors):
            message = b.CreateString(e.message)
            b.StartObject(2)
            b.PrependInt64Slot(0, e.code, 0)
            b.PrependUOffsetTRelativeSlot(1, message, 0)
            built.append(b.EndObject())
        b.StartVector(4, len(built), 4)
        for offset in built:
            b.PrependUOffsetTRelative(offset)
        vector, slot = b.EndVector(), 1
    else:
        arrays = list(outputs or [])
        b = new_builder(256 + sum(encoded_size(np.asarray(a)) for a in arrays))
        vector, slot = add_tensor_vector(b, arrays, data_alignment), 0
    b.StartObject(2)
    b.PrependUOffsetTRelativeSlot(slot, vector, 0)
    return finish(b, b.EndObject())


def decode_infer_response(buf: bytes | bytearray | memoryview) -> InferResponse:
    try:
        root = Table.root(buf)
        outputs = [decode_tensor(t, f"output tensor {i}") for i, t in enumerate(root.tables(0))]
        errors = [ErrorInfo(e.i64(0), _text(e.string(1), "an error message")) for e in root.tables(1)]
        return InferResponse(outputs, errors)
    except CodecError:
        raise
    except (ValueError, IndexError, OverflowError) as exc:
        raise CodecError(f"undecodable InferResponse: {exc}") from exc


def encode_metadata_response(meta: MetadataResponse) -> memoryview:
    b = new_builder(4096)

    def io_table(io: IOMetadata) -> int:
        name = b.CreateString(io.name)
        description = b.CreateString(io.description) if io.description else None
        b.StartVector(8, len(io.shape), 8)
        for dim in reversed(io.shape):
            b.PrependInt64(dim)
        shape = b.EndVector()
        b.StartObject(4)
        b.PrependUOffsetTRelativeSlot(0, name, 0)
        if description is not None:
            b.PrependUOffsetTRelativeSlot(1, description, 0)
        b.PrependUOffsetTRelativeSlot(2, shape, 0)
        b.PrependUint8Slot(3, int(io.type), 0)
        return b.EndObject()

    def io_vector(items: list[IOMetadata]) -> int:
        tables = [io_table(io) for io in reversed(items)]
        b.StartVector(4, len(tables), 4)
        for offset in tables:
            b.PrependUOffsetTRelative(offset)
        return b.EndVector()

    strings = [
        b.CreateString(s) if s else None for s in (meta.name, meta.version, meta.server, meta.description)
    ]
    inputs, outputs = io_vector(meta.inputs), io_vector(meta.outputs)
    b.StartObject(6)
    for slot, offset in enumerate(strings):
        if offset is not None:
            b.PrependUOffsetTRelativeSlot(slot, offset, 0)
    b.PrependUOffsetTRelativeSlot(4, inputs, 0)
    b.PrependUOffsetTRelativeSlot(5, outputs, 0)
    return finish(b, b.EndObject())


def decode_metadata_response(buf: bytes | bytearray | memoryview) -> MetadataResponse:
    try:
        root = Table.root(buf)

        def io(t: Table) -> IOMetadata:
            vec = t.vector(2, 8)
            shape = np.frombuffer(t.buf, "<i8", vec[1], vec[0]).tolist() if vec else []
            type_id = t.u8(3)
            return IOMetadata(
                name=_text(t.string(0), "an IOMetadata name"),
                type=Type(type_id) if type_id in Type._value2member_map_ else Type.Null,
                shape=shape,
                description=_text(t.string(1), "an IOMetadata description"),
            )

        fields = [_text(root.string(i), "a metadata string") for i in range(4)]
        return MetadataResponse(
            *fields, inputs=[io(t) for t in root.tables(4)], outputs=[io(t) for t in root.tables(5)]
        )
    except CodecError:
        raise
    except (ValueError, IndexError, OverflowError) as exc:
        raise CodecError(f"undecodable MetadataResponse: {exc}") from exc
