"""GraphPipe error kinds: the numeric `Error.code` of each, and the HTTP status we answer with.

Oracle's client only reads the body of a 200 answer (it raises `requests.HTTPError` on any
other status and `Exception(message)` on a non-empty `errors` list), so every error we can
describe is sent as an InferResponse with `errors` and status 200: the caller sees our message
naming the input or output. Two cases are refused at the HTTP level instead, still with an
InferResponse body: a body over --graphpipe-max-request-mb (413) and a path that names no
model (404), and with --auth-token a request without the token (401).
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    UNDECODABLE = 1  # the body is not a GraphPipe Request flatbuffer (or a tensor in it is inconsistent)
    UNKNOWN_INPUT = 2  # an input name the model does not have
    UNKNOWN_OUTPUT = 3  # an output name the model does not have
    WRONG_TYPE = 4  # a tensor's Type differs from the model's input type
    WRONG_SHAPE = 5  # rank or a fixed dimension differs from the model's input shape
    TOO_LARGE = 6  # request body over the size limit
    MODEL_FAILURE = 7  # the model raised while running
    BAD_REQUEST = 8  # other invalid requests: name/tensor count mismatch, bad config, bad values
    UNKNOWN_MODEL = 9  # no model is served at the request's path
    UNAVAILABLE = 10  # the server is shutting down: in-flight and new requests get this
    UNAUTHENTICATED = 11  # --auth-token is set and the request lacks `Authorization: Bearer` with it
    OVERLOADED = 12  # more than --max-queued requests are in flight: retry later


HTTP_STATUS = {
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.OVERLOADED: 429,
}


class GraphPipeError(Exception):
    """An error that becomes one `Error` in an InferResponse."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 200)
