"""Serving one model: request bytes in, response bytes out (no sockets here).

`ModelEndpoint.handle(body)` decodes the Request, answers a MetadataRequest, or checks an
InferRequest against the model's metadata (names, types, ranks, fixed dimensions), resolves
default names, submits it to the model's Batcher and encodes the outputs. Every failure
becomes an InferResponse with one Error (code from errors.ErrorCode) naming what was wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenwire.protocols.graphpipe.batcher import Batcher
from tokenwire.protocols.graphpipe.cache import ResponseCache
from tokenwire.protocols.graphpipe.codec import (
    CodecError,
    ErrorInfo,
    InferRequest,
    IOMetadata,
    decode_request,
    encode_infer_response,
    encode_metadata_response,
)
from tokenwire.protocols.graphpipe.errors import ErrorCode, GraphPipeError
from tokenwire.protocols.graphpipe.models.base import TensorModel
from tokenwire.protocols.graphpipe.types import Type, type_name, type_of_dtype

log = logging.getLogger("tokenwire.graphpipe")
VERSION = "1.0"


@dataclass
class Reply:
    status: int
    body: bytes | bytearray | memoryview
    error_code: int | None = None


def error_reply(err: GraphPipeError) -> Reply:
    return Reply(
        err.http_status, encode_infer_response(errors=[ErrorInfo(int(err.code), err.message)]), err.code
    )


def _shape(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_input(io: IOMetadata, arr: np.ndarray) -> None:
    """Raise if `arr` does not fit the model input `io` (type, rank, fixed dimensions)."""
    try:
        got = type_of_dtype(arr.dtype)
    except TypeError:
        got = Type.Null
    if io.type != Type.Null and got != io.type:
        raise GraphPipeError(
            ErrorCode.WRONG_TYPE, f"input {io.name!r} must be {type_name(io.type)}, got {type_name(got)}"
        )
    fits = len(io.shape) == arr.ndim and all(
        d < 0 or d == a for d, a in zip(io.shape, arr.shape, strict=True)
    )
    if io.shape and not fits:
        raise GraphPipeError(
            ErrorCode.WRONG_SHAPE,
            f"input {io.name!r} must have shape {_shape(io.shape)} (-1 = any), got {_shape(arr.shape)}",
        )


def resolve_call(model: TensorModel, req: InferRequest) -> tuple[dict[str, np.ndarray], list[str], Any]:
    """Validate an InferRequest against the model; returns (inputs by name, outputs, config)."""
    names = req.input_names or model.default_inputs
    if len(names) != len(req.inputs):
        what = "input_names" if req.input_names else f"the model's default inputs {model.default_inputs}"
        raise GraphPipeError(
            ErrorCode.BAD_REQUEST, f"{len(req.inputs)} input tensors but {len(names)} names in {what}"
        )
    by_name = {io.name: io for io in model.inputs}
    inputs: dict[str, np.ndarray] = {}
    for name, arr in zip(names, req.inputs, strict=True):
        io = by_name.get(name)
        if io is None:
            raise GraphPipeError(
                ErrorCode.UNKNOWN_INPUT, f"unknown input {name!r}; the model's inputs are {list(by_name)}"
            )
        if name in inputs:
            raise GraphPipeError(ErrorCode.BAD_REQUEST, f"input {name!r} is given twice")
        check_input(io, arr)
        inputs[name] = arr
    missing = [n for n in by_name if n not in inputs]
    if missing:
        raise GraphPipeError(ErrorCode.BAD_REQUEST, f"missing inputs {missing}")
    outputs = req.output_names or model.default_outputs
    known = {io.name for io in model.outputs}
    for name in outputs:
        if name not in known:
            raise GraphPipeError(
                ErrorCode.UNKNOWN_OUTPUT, f"unknown output {name!r}; the model's outputs are {sorted(known)}"
            )
    rows = {a.shape[0] for a in inputs.values() if a.ndim}
    if model.stackable and len(rows) > 1:
        raise GraphPipeError(ErrorCode.WRONG_SHAPE, f"inputs disagree on the batch dimension: {sorted(rows)}")
    config = model.parse_config(req.config)
    model.check_values(inputs, list(outputs), config)
    return inputs, list(outputs), config


class ModelEndpoint:
    def __init__(
        self,
        model: TensorModel,
        *,
        window_s: float = 0.0,
        max_batch: int = 64,
        cache: ResponseCache | None = None,
        inline_max_s: float = 0.0,
    ) -> None:
        self.model = model
        self.batcher = Batcher(model, window_s=window_s, max_batch=max_batch, inline_max_s=inline_max_s)
        self.cache = cache
        self.metadata = model.metadata(VERSION)
        self._metadata_bytes = bytes(encode_metadata_response(self.metadata))

    async def handle(self, body: bytes | memoryview, *, alone: bool = False) -> Reply:
        """`alone`: no other request is in flight (the batcher may run a short call inline)."""
        key = ResponseCache.key(self.model.name, body) if self.cache is not None else None
        if key is not None and self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return Reply(200, hit)
        try:
            req = decode_request(body)
        except CodecError as exc:
            return error_reply(GraphPipeError(ErrorCode.UNDECODABLE, str(exc)))
        if not isinstance(req, InferRequest):
            return Reply(200, self._metadata_bytes)
        try:
            inputs, outputs, config = resolve_call(self.model, req)
        except GraphPipeError as err:
            return error_reply(err)
        try:
            results = await self.batcher.submit(inputs, outputs, config, alone=alone)
        except GraphPipeError as err:
            return error_reply(err)
        except Exception as exc:  # the model broke on this request; keep serving the others
            log.warning("model %s failed: %s", self.model.name, exc, exc_info=True)
            return error_reply(
                GraphPipeError(
                    ErrorCode.MODEL_FAILURE, f"model {self.model.name!r} failed on outputs {outputs}: {exc}"
                )
            )
        try:
            reply = encode_infer_response(results)
        except TypeError as exc:
            return error_reply(
                GraphPipeError(ErrorCode.MODEL_FAILURE, f"model output cannot be encoded: {exc}")
            )
        if key is not None and self.cache is not None:
            self.cache.put(key, bytes(reply))
        return Reply(200, reply)

    async def close(self) -> None:
        await self.batcher.close()
        self.model.close()
