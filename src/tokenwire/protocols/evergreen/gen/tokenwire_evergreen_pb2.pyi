from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateConfig(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "logprobs", "top_logprobs", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ConstraintConfig(_message.Message):
    __slots__ = ("regex", "json_schema", "lark")
    REGEX_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    regex: str
    json_schema: str
    lark: str
    def __init__(self, regex: _Optional[str] = ..., json_schema: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TtlConfig(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class SessionOptions(_message.Message):
    __slots__ = ("partial_failures",)
    PARTIAL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    partial_failures: bool
    def __init__(self, partial_failures: _Optional[bool] = ...) -> None: ...

class ActionError(_message.Message):
    __slots__ = ("action", "output_id", "code", "code_name", "message")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    CODE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    action: str
    output_id: str
    code: int
    code_name: str
    message: str
    def __init__(self, action: _Optional[str] = ..., output_id: _Optional[str] = ..., code: _Optional[int] = ..., code_name: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class EndOfTurn(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
