"""Client messages, checked and turned into plain values before anything reaches the engine.

Every check failure raises RequestError naming the field, so the server can answer with an
error record for that stream. Fields an extension adds are accepted only once the client has
negotiated that extension (see HELLO in docs/lmtp.md); stock clients get the seed's protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenwire.engine.request import (
    GenerateOptions,
    InvalidValueError,
    SamplingParams,
    require_int,
    require_number,
    require_seed,
)
from tokenwire.protocols.lmtp.codec import EXTENSIONS, StreamId

__all__ = ["EXTENSIONS", "StreamId"]

# Decoder keys LMQL's server passes on for GENERATE and ignores for SCORE.
_SAMPLING = ("max_tokens", "temperature", "logit_bias", "top_logprobs", "top_p", "top_k", "seed")
_GENERATE = {"stream_id", "model", "prompt", *_SAMPLING, "priority", "stop_token_ids", "ignore_eos"}
_SCORE = {"stream_id", "model", "prompt", "scored", *_SAMPLING, "priority"}
_EXT_FIELDS = {"buffer": "buffers", "save_as": "buffers", "keep": "buffers", "resume_from": "retry"}
MAX_TOP_LOGPROBS = 1000
MAX_BIAS = 1e4  # larger biases only overflow the softmax (LMQL's masks use +-100)
T = TypeVar("T")


class RequestError(Exception):
    """A request the server refuses; `code` names the kind of failure for the retry extension."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_field",
        stream_id: StreamId | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.stream_id = stream_id
        self.retryable = retryable


@dataclass(frozen=True)
class BufferRef:
    name: str


PromptItem = int | str | BufferRef


@dataclass
class Generate:
    stream_id: StreamId
    model: str
    prompt: list[PromptItem]
    prompt_is_text: bool = False  # the prompt was one string: encoded with the tokenizer's specials
    max_tokens: int = 32
    temperature: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 1
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    priority: int = 5
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    buffer: str | None = None
    save_as: str | None = None
    keep: bool = False  # save_as's buffer outlives the connection (and the server: --state-dir)
    resume_from: int = 0

    def options(self) -> GenerateOptions:
        sampling = SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.logit_bias)
        return GenerateOptions(
            max_tokens=self.max_tokens,
            sampling=sampling,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=True,
            top_logprobs=self.top_logprobs,
            logprob_mode="processed",  # after logit_bias, as LMQL's server reports GENERATE
            priority=self.priority,
        )


@dataclass
class Score:
    stream_id: StreamId
    model: str
    prompt: list[PromptItem]
    scored: list[int] | str
    prompt_is_text: bool = False
    priority: int = 5
    buffer: str | None = None
    resume_from: int = 0

    def options(self, start: int, end: int) -> GenerateOptions:
        # the model's own distribution, no bias: LMQL's server scores without logit_bias
        return GenerateOptions(
            max_tokens=0, logprob_ranges=[(start, end)], logprob_mode="raw", priority=self.priority
        )


@dataclass
class ModelInfo:
    stream_id: StreamId
    model: str
    data: dict[str, Any]


@dataclass
class Hello:
    stream_id: StreamId | None
    extensions: list[str]
    client: str | None


@dataclass
class BufferPut:
    stream_id: StreamId
    name: str
    prompt: list[PromptItem]
    prompt_is_text: bool
    base: str | None
    keep: bool = False  # the buffer outlives the connection (and the server: --state-dir)


@dataclass
class BufferDrop:
    stream_id: StreamId
    name: str


@dataclass
class Cancel:
    stream_id: StreamId


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stream_id_of(payload: Any) -> StreamId | None:
    """The payload's stream_id if it has a usable one (for error records of bad requests)."""
    if isinstance(payload, dict):
        sid = payload.get("stream_id")
        if isinstance(sid, str) or (isinstance(sid, int) and not isinstance(sid, bool)):
            return sid
    return None


class _Fields:
    """Typed access to one payload's fields; every failure names the field."""

    def __init__(self, kind: str, payload: Any, allowed: set[str], enabled: set[str]) -> None:
        if not isinstance(payload, dict):
            raise RequestError(f"{kind} payload must be a JSON object, got {type(payload).__name__}")
        self.kind, self.p = kind, payload
        self.sid = stream_id_of(payload)
        unknown = sorted(k for k in payload if k not in allowed and _EXT_FIELDS.get(k) not in enabled)
        if unknown:
            needs = [
                f"{k} (extension '{_EXT_FIELDS[k]}' not negotiated)" for k in unknown if k in _EXT_FIELDS
            ]
            other = [k for k in unknown if k not in _EXT_FIELDS]
            raise self.error(f"{kind}: unsupported field(s): {', '.join(other + needs)}")

    def error(self, message: str, code: str = "invalid_field") -> RequestError:
        return RequestError(message, code, self.sid)

    def stream_id(self) -> StreamId:
        if "stream_id" not in self.p:
            raise self.error(f"{self.kind}: missing field 'stream_id'")
        if self.sid is None:
            raise self.error(f"{self.kind}: stream_id must be an integer or a string")
        return self.sid

    def has(self, name: str) -> bool:
        return self.p.get(name) is not None

    def string(self, name: str, required: bool = False) -> str | None:
        value = self.p.get(name)
        if value is None:
            if required:
                raise self.error(f"{self.kind}: missing field '{name}'")
            return None
        if not isinstance(value, str) or not value:
            raise self.error(f"{self.kind}: {name} must be a non-empty string")
        return value

    def checked(self, check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One of the engine's numeric rules (engine/request.py), its refusal as this message's."""
        try:
            return check(*args, **kwargs)
        except InvalidValueError as exc:
            raise self.error(f"{self.kind}: {exc}") from None

    def integer(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        value = self.p.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JavaScript clients send 3.0 for 3
        return self.checked(require_int, value, name, lo, hi)

    def number(self, name: str, default: float) -> float:
        value = self.p.get(name)
        if value is None:
            return default
        return self.checked(require_number, value, name)

    def boolean(self, name: str) -> bool:
        value = self.p.get(name, False)
        if not isinstance(value, bool):
            raise self.error(f"{self.kind}: {name} must be true or false, got {value!r}")
        return value

    def token_list(self, name: str, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(_is_int(t) for t in value):
            raise self.error(f"{self.kind}: {name} must be a list of token ids (integers)")
        return value

    def prompt(self, name: str, enabled: set[str], required: bool = True) -> tuple[list[PromptItem], bool]:
        """A prompt: token ids; with 'text' also a string or strings in the list; with 'buffers'
        also {"buffer": NAME} items in the list. Returns (items, whether it was one string)."""
        value = self.p.get(name)
        if value is None:
            if required:
                raise self.error(f"{self.kind}: missing field '{name}'")
            return [], False
        if isinstance(value, str):
            if "text" not in enabled:
                raise self.error(
                    f"{self.kind}: {name} must be a list of token ids (text prompts need "
                    "the 'text' extension)"
                )
            return [value], True
        if not isinstance(value, list):
            raise self.error(f"{self.kind}: {name} must be a list of token ids")
        items: list[PromptItem] = []
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                items.append(item)
            elif isinstance(item, str) and "text" in enabled:
                items.append(item)
            elif (
                isinstance(item, dict)
                and "buffers" in enabled
                and set(item) == {"buffer"}
                and isinstance(item["buffer"], str)
            ):
                items.append(BufferRef(item["buffer"]))
            else:
                raise self.error(f"{self.kind}: {name} must be a list of token ids, got an item {item!r}")
        return items, False

    def logit_bias(self) -> dict[int, float]:
        value = self.p.get("logit_bias")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(f"{self.kind}: logit_bias must be an object mapping token ids to numbers")
        bias: dict[int, float] = {}
        for key, v in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise self.error(f"{self.kind}: logit_bias key {key!r} is not a token id") from None
            number = self.checked(require_number, v, "logit_bias", what=f"logit_bias[{key!r}]")
            bias[token] = min(max(number, -MAX_BIAS), MAX_BIAS)
        return bias


def parse_generate(payload: Any, enabled: set[str]) -> Generate:
    f = _Fields("GENERATE", payload, _GENERATE, enabled)
    sid = f.stream_id()
    model = f.string("model", required=True)
    assert model is not None
    msg = Generate(sid, model, [], buffer=f.string("buffer"), save_as=f.string("save_as"))
    msg.prompt, msg.prompt_is_text = f.prompt("prompt", enabled, required=msg.buffer is None)
    msg.max_tokens = f.integer("max_tokens", 32, 1)
    msg.temperature = f.number("temperature", 0.0)
    msg.logit_bias = f.logit_bias()
    msg.top_logprobs = f.integer("top_logprobs", 1, 0, MAX_TOP_LOGPROBS)
    msg.top_p = f.number("top_p", 1.0)
    msg.top_k = f.integer("top_k", 0, 0)
    msg.seed = f.checked(require_seed, f.integer("seed", 0)) if f.has("seed") else None
    msg.priority = f.integer("priority", 5, 0, 10)
    msg.stop_token_ids = f.token_list("stop_token_ids", f.p.get("stop_token_ids") or [])
    msg.ignore_eos = f.boolean("ignore_eos")
    msg.keep = f.boolean("keep")
    if msg.keep and msg.save_as is None:
        raise f.error("GENERATE: keep applies to save_as's buffer: give save_as")
    msg.resume_from = f.integer("resume_from", 0, 0)
    f.checked(msg.options().validate)  # the ranges: temperature >= 0, top_p in (0, 1], ...
    return msg


def parse_score(payload: Any, enabled: set[str]) -> Score:
    f = _Fields("SCORE", payload, _SCORE, enabled)
    sid = f.stream_id()
    model = f.string("model", required=True)
    assert model is not None
    buffer = f.string("buffer")
    prompt, is_text = f.prompt("prompt", enabled, required=buffer is None)
    scored = f.p.get("scored")
    if scored is None:
        raise f.error("SCORE: missing field 'scored'")
    if isinstance(scored, str) and "text" in enabled:
        if not scored:
            raise f.error("SCORE: scored must not be empty")
    else:
        scored = f.token_list("scored", scored)
        if not scored:
            raise f.error("SCORE: scored must contain at least one token")
    for name in _SAMPLING:  # accepted for LMQL compatibility, checked for type, not used
        if f.has(name) and name != "logit_bias":
            f.number(name, 0.0)
    return Score(
        sid,
        model,
        prompt,
        scored,
        is_text,
        f.integer("priority", 5, 0, 10),
        buffer,
        f.integer("resume_from", 0, 0),
    )


def parse_model_info(payload: Any, enabled: set[str]) -> ModelInfo:
    f = _Fields("MODEL_INFO", payload, {"stream_id", "model", "data"}, enabled)
    sid = f.stream_id()
    model = f.string("model", required=True)
    assert model is not None
    data = f.p.get("data") or {}
    if not isinstance(data, dict):
        raise f.error("MODEL_INFO: data must be a JSON object")
    return ModelInfo(sid, model, data)


def parse_hello(payload: Any) -> Hello:
    f = _Fields("HELLO", payload, {"stream_id", "extensions", "client"}, set())
    exts = f.p.get("extensions") or []
    if not isinstance(exts, list) or not all(isinstance(e, str) for e in exts):
        raise f.error("HELLO: extensions must be a list of names")
    return Hello(f.sid, exts, f.string("client"))


def parse_buffer(payload: Any, enabled: set[str]) -> BufferPut:
    f = _Fields("BUFFER", payload, {"stream_id", "name", "prompt", "base", "keep"}, enabled)
    sid = f.stream_id()
    name = f.string("name", required=True)
    assert name is not None
    prompt, is_text = f.prompt("prompt", enabled, required=False)
    return BufferPut(sid, name, prompt, is_text, f.string("base"), f.boolean("keep"))


def parse_drop(payload: Any, enabled: set[str]) -> BufferDrop:
    f = _Fields("DROP", payload, {"stream_id", "name"}, enabled)
    sid = f.stream_id()
    name = f.string("name", required=True)
    assert name is not None
    return BufferDrop(sid, name)


def parse_cancel(payload: Any, enabled: set[str]) -> Cancel:
    f = _Fields("CANCEL", payload, {"stream_id"}, enabled)
    return Cancel(f.stream_id())
