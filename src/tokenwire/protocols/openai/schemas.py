"""The request bodies of the OpenAI-compatible API, as pydantic models.

FastAPI validates every body against these and serves them at /openapi.json. Unknown fields are
refused (a typo must not be silently ignored) except the OpenAI fields listed in IGNORED_FIELDS,
which only concern OpenAI's hosted service (billing, storage, tiers) and change nothing here.
Responses are built as plain dicts in core.py: on the streaming path a pydantic model per chunk
would cost more than the rest of the per-token work together.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenwire.engine.request import require_int, require_number

# OpenAI fields a stock client may send that only matter to OpenAI's own service.
# The stop matcher keeps a window of the longest stop string and scans it on every token
# (engine/stop.py: O(chunk + longest stop) per stop): a 60 MB stop string inside the body cap
# made each token cost a scan of 60 MB. OpenAI documents up to 4 stops and no length.
MAX_STOP_CHARS = 1024
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key")


def _integer(value: Any, info: ValidationInfo) -> Any:
    """JSON's true/false are not integers, though pydantic (Python) reads them as 1/0: refused
    by the engine's rule (engine/request.py), naming the field."""
    if isinstance(value, bool):
        require_int(value, info.field_name or "value")
    return value


def _number(value: Any, info: ValidationInfo) -> Any:
    """A number is finite and not a bool (Python's json reads NaN, Infinity and 1e999): the
    engine's rule (engine/request.py), naming the field."""
    if isinstance(value, int | float):
        return require_number(value, info.field_name or "value")
    return value


def _token_ids(value: Any, info: ValidationInfo) -> Any:
    """A prompt of token ids (a list, or a list of lists) holds no true/false: named here, where
    the union of prompt forms would only say that no form matched."""
    for item in value if isinstance(value, list) else ():
        for token in item if isinstance(item, list) else (item,):
            if isinstance(token, bool):
                field = info.field_name or "prompt"
                require_int(token, field, what=f"{field}: a token id")
    return value


# the request's integers and numbers: pydantic checks the type and range, these refuse the rest
Int = Annotated[int, BeforeValidator(_integer)]
Number = Annotated[float, BeforeValidator(_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks; nothing to obfuscate here


class ContentPart(_Strict):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class Sampling(_Strict):
    """Fields chat and completions share, OpenAI's and tokenwire's extensions (sent by stock
    clients through `extra_body`, as vLLM's are)."""

    model: str
    max_tokens: Int | None = Field(default=None, ge=0)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    n: Int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(
        default=None, description="0 <= seed < 2**64; choice i of n samples with (seed + i) mod 2**64"
    )
    logit_bias: dict[str, float] | None = None
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    # OpenAI fields that change nothing here (see IGNORED_FIELDS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    # tokenwire extensions
    session: str | None = Field(default=None, description="append to this engine session (POST /v1/sessions)")
    top_k: Int | None = Field(default=None, ge=0)
    priority: Int | None = Field(default=None, ge=0, le=10, description="0 interactive ... 10 batch")
    regex: str | None = Field(default=None, description="constrain the output to this regular expression")
    grammar: str | None = Field(default=None, description="constrain the output to this Lark grammar")
    readouts: bool = Field(default=False, description="concept projections per token (needs --concepts)")
    ignore_eos: bool = False
    speculate: bool = Field(
        default=True, description="false: no prompt-lookup guesses for this request (--speculate)"
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_numbers(cls, bias: Any) -> Any:
        """Each value a finite number, not a bool (the engine's rule), named as logit_bias."""
        for key, value in bias.items() if isinstance(bias, dict) else ():
            if isinstance(value, int | float):
                require_number(value, "logit_bias", what=f"logit_bias[{key!r}]")
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"key {key!r} is not a token id")
            if not -100 <= value <= 100:
                raise ValueError(f"value {value} for token {key} is outside [-100, 100]")
        return bias

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


PromptInput = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(Sampling):
    prompt: Annotated[PromptInput, BeforeValidator(_token_ids)]
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: Int | None = Field(default=None, ge=1)


class SessionCreate(_Strict):
    ttl: Number | None = Field(
        default=None, gt=0, description="idle lifetime in seconds (default --session-ttl)"
    )
    prompt: Annotated[str | list[Int] | None, BeforeValidator(_token_ids)] = Field(
        default=None, description="initial text or token ids"
    )
    model: str | None = None


class SessionFork(_Strict):
    at: Int | None = Field(default=None, ge=0, description="keep tokens [0, at) (default: all)")


class SessionTruncate(_Strict):
    length: Int = Field(ge=0)
