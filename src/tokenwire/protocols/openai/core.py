"""The sans-IO core of the OpenAI-compatible API: validated requests -> engine plans (responses.py
turns the choices' outputs into OpenAI's response and chunk objects).

Everything here works on plain values (pydantic requests, token lists, the model's limits) and
raises OpenAIError for a request it refuses; transport.py moves these values between HTTP and the
engine. Every check runs before the engine is touched, so a refused request changes no session.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.admission import Limits, check_request
from tokenwire.engine.errors import EngineError, InvalidRequestError
from tokenwire.engine.request import GenerateOptions, InvalidValueError
from tokenwire.engine.vision import ImageInput
from tokenwire.model.tokenizer import Tokenizer
from tokenwire.protocols.openai import chat
from tokenwire.protocols.openai.errors import bad_request, from_engine, model_not_found
from tokenwire.protocols.openai.images import ChatImage, ChatVision, place_images
from tokenwire.protocols.openai.output import ChoiceOutput
from tokenwire.protocols.openai.sampling import Structure, check_one_structure, compile_structure, options_for
from tokenwire.protocols.openai.schemas import ChatCompletionRequest, CompletionRequest, Sampling

EVERY = 2**31  # "to the end" in a position range
SESSION_TAIL = 16  # session tokens the chat continuation needs to see (a closing sequence)


@dataclass(frozen=True)
class ModelLimits:
    """What the core needs to know about the loaded model and its engine."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    logits_size: int
    eos_ids: frozenset[int]
    engine: Limits  # the engine's admission limits (engine.limits)
    concept_names: tuple[str, ...] = ()
    concept_layers: tuple[int, ...] = ()
    vision: ChatVision | None = None  # a vision model's image blocks (image_url parts)


@dataclass
class Plan:
    """What to run for one request: per prompt the tokens to append, per choice its options."""

    kind: str  # "chat" | "text"
    model: str
    session: str | None
    prompts: list[list[int]]
    choices: list[tuple[int, GenerateOptions]]  # (prompt index, options)
    outputs: list[ChoiceOutput]
    stream: bool
    include_usage: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    tool_mode: str = "none"
    tool: Any = None
    tool_names: set[str] = field(default_factory=set)
    readouts: bool = False
    limits: ModelLimits | None = None
    images: list[ImageInput] = field(default_factory=list)  # attached to prompts[0] (chat)


def check_model(requested: str | None, limits: ModelLimits) -> None:
    if requested is not None and requested != limits.name:
        raise model_not_found(requested, limits.name)


# Choices (prompts x n) one request may ask for: each runs to at most the context, so a request
# is at most this many contexts of work; a batch of 10^5 one-character prompts x n=16 was
# 1.6*10^6 choices, tokenized and planned before any limit looked at them. The default
# --max-queued: a request with more choices could never be queued whole anyway.
MAX_CHOICES = 256


def _check_common(req: Sampling, limits: ModelLimits) -> None:
    check_model(req.model, limits)
    bias = req.logit_bias or {}
    if len(bias) > limits.vocab_size:  # counted before each entry becomes an engine-side bias
        raise bad_request(
            f"logit_bias has {len(bias)} entries, more than the vocabulary ({limits.vocab_size} ids)",
            "logit_bias",
            "invalid_value",
        )
    for key in bias:
        if int(key) < 0:  # the engine's vocabulary check below names the others
            raise bad_request(f"logit_bias: token id {key} is negative", "logit_bias", "invalid_token")


@contextlib.contextmanager
def _text_of(param: str) -> Iterator[None]:
    """The tokenizer refuses text that is not valid Unicode (a lone UTF-16 surrogate, sent
    escaped or as raw bytes, which JSON decoding lets through): the client's error, a 400."""
    try:
        yield
    except InvalidRequestError as exc:
        raise bad_request(f"{param}: {exc}", param, "invalid_value") from None


def _max_tokens(requested: int | None, prompt_len: int, limits: ModelLimits) -> int:
    """OpenAI's default is "until the context is full"; a larger request is capped there."""
    room = max(limits.max_model_len - prompt_len, 0)
    return room if requested is None else min(requested, room)


def _admit(
    limits: ModelLimits,
    prompt_len: int,
    append: list[int],
    options: GenerateOptions,
    param: str,
    names: dict[str, str] | None = None,
    *,
    first: bool = True,
) -> None:
    """The engine's own admission check (its numeric rules, context, vocabulary, KV budget,
    readouts) before anything is started, its message passed on; the field is the one the
    engine names (`names`: the engine's field names -> this request's), else read off its
    message. The choices after the first differ only in their options: those are checked."""
    names = {"append": param, **(names or {})}
    try:
        if first:
            check_request(limits.engine, prompt_len, append, options, names=names, needs_room=True)
        else:
            options.validate(names)
    except EngineError as exc:
        message = str(exc)
        field = (
            exc.field
            if isinstance(exc, InvalidValueError)
            else "logit_bias"
            if message.startswith("logit_bias")
            else "readouts"
            if "readout" in message
            else param
        )
        raise from_engine(exc, field) from exc


def plan_chat(req: ChatCompletionRequest, limits: ModelLimits, session_tokens: Sequence[int] | None) -> Plan:
    """`session_tokens`: the session's tokens when the request names one (None otherwise)."""
    _check_common(req, limits)
    tok = limits.tokenizer
    mode, named = chat.tool_mode(req, tok)
    response_schema = None
    if req.response_format is not None and req.response_format.type != "text":
        rf = req.response_format
        response_schema = rf.json_schema.json_schema if rf.json_schema else None
        response_schema = response_schema or {"type": "object"}
    tool_schema = chat.tool_schema(mode, named, req.tools or [])
    check_one_structure(
        ("response_format", response_schema),
        ("tool_choice", tool_schema),
        ("regex", req.regex),
        ("grammar", req.grammar),
    )
    structure = _structure(req, response_schema, tool_schema)
    tools = chat.tool_dicts(req.tools) if req.tools and mode != "none" else None
    images: list[ChatImage] = []
    messages = chat.template_messages(req.messages, limits.vision, images)
    history = list(session_tokens or ())
    with _text_of("messages"):
        append = chat.prompt_tokens(tok, messages, history[-SESSION_TAIL:], tools)
    placed = place_images(append, images, limits.vision, len(history)) if limits.vision else []
    prompt_len = len(history) + len(append)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(requested, prompt_len, limits)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    plan = Plan(
        "chat",
        limits.name,
        req.session,
        [append],
        [],
        [],
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        id=f"chatcmpl-{uuid.uuid4().hex}",
        tool_mode=mode,
        tool=named,
        tool_names={t.function.name for t in req.tools or []},
        readouts=req.readouts,
        limits=limits,
        images=placed,
    )
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
    for i in range(req.n):
        options = options_for(
            req,
            choice=i,
            max_tokens=max_tokens,
            constraint=compile_structure(structure, tok.hf, limits.logits_size),
            width=limits.logits_size,
            logprobs=req.logprobs,
            top_logprobs=top,
            logprob_ranges=None,
            readout_ranges=[(prompt_len, EVERY)] if req.readouts else [],
        )
        _admit(limits, prompt_len, append, options, "messages", names, first=i == 0)
        plan.choices.append((0, options))
        plan.outputs.append(
            ChoiceOutput(
                i, tok, limits.eos_ids, stops=req.stops, ignore_eos=req.ignore_eos, legacy_logprobs=False
            )
        )
    return plan


def _structure(req: ChatCompletionRequest, response: Any, tool: Any) -> Structure | None:
    if response is not None:
        return Structure("json_schema", response, "response_format")
    if tool is not None:
        return Structure("json_schema", tool, "tools")
    return _extension_structure(req)


def _extension_structure(req: Sampling) -> Structure | None:
    if req.regex:
        return Structure("regex", req.regex, "regex")
    if req.grammar:
        return Structure("lark", req.grammar, "grammar")
    return None


def _prompts(prompt: Any, tok: Tokenizer, limits: ModelLimits, fresh: bool) -> list[list[int]]:
    """The completions API's four prompt forms -> token lists. Text gets the tokenizer's special
    tokens (BOS) only at the start of a sequence, not when appended to a session."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            with _text_of("prompt"):
                out.append(tok.encode(p, add_special_tokens=fresh))
            continue
        if len(p) > limits.max_model_len:  # counted before 10^7 ids are checked one by one
            raise bad_request(
                f"prompt[{i}] has {len(p)} token ids, more than the model's context "
                f"({limits.max_model_len} tokens, --max-model-len)",
                "prompt",
                "context_length_exceeded",
            )
        for t in p:
            if not 0 <= t < limits.vocab_size:
                raise bad_request(
                    f"prompt[{i}]: token id {t} is outside the vocabulary [0, {limits.vocab_size})",
                    "prompt",
                    "invalid_token",
                )
        out.append(list(p))
    if not out:
        raise bad_request("prompt is empty", "prompt")
    return out


def plan_completion(
    req: CompletionRequest, limits: ModelLimits, session_tokens: Sequence[int] | None
) -> Plan:
    _check_common(req, limits)
    if req.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt) else [0]
    if len(batch) * req.n > MAX_CHOICES:  # counted before any prompt is tokenized
        raise bad_request(
            f"{len(batch)} prompts x n={req.n} is {len(batch) * req.n} choices, more than "
            f"{MAX_CHOICES} a request",
            "prompt",
            "too_many_choices",
        )
    check_one_structure(("regex", req.regex), ("grammar", req.grammar))
    structure = _extension_structure(req)
    tok = limits.tokenizer
    history = len(session_tokens or ())
    prompts = _prompts(req.prompt, tok, limits, fresh=history == 0)
    if req.session is not None and len(prompts) > 1:
        raise bad_request("a request on a session takes one prompt", "prompt")
    legacy = req.logprobs is not None
    plan = Plan(
        "text",
        limits.name,
        req.session,
        prompts,
        [],
        [],
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        id=f"cmpl-{uuid.uuid4().hex}",
        readouts=req.readouts,
        limits=limits,
    )
    for p, append in enumerate(prompts):
        prompt_len = history + len(append)
        max_tokens = _max_tokens(16 if req.max_tokens is None else req.max_tokens, prompt_len, limits)
        start = history if req.echo else prompt_len  # echo: logprobs/readouts of the prompt too
        for i in range(req.n):
            options = options_for(
                req,
                choice=i,
                max_tokens=max_tokens,
                constraint=compile_structure(structure, tok.hf, limits.logits_size),
                width=limits.logits_size,
                logprobs=legacy,
                top_logprobs=req.logprobs or 0,
                logprob_ranges=[(start, EVERY)] if legacy else None,
                readout_ranges=[(start, EVERY)] if req.readouts else [],
            )
            _admit(limits, prompt_len, append, options, "prompt", {"top_logprobs": "logprobs"}, first=i == 0)
            plan.choices.append((p, options))
            plan.outputs.append(
                ChoiceOutput(
                    len(plan.outputs),
                    tok,
                    limits.eos_ids,
                    stops=req.stops,
                    ignore_eos=req.ignore_eos,
                    legacy_logprobs=True,
                    echo_from=history if req.echo else None,
                    echo_text=tok.decode(append) if req.echo else "",
                )
            )
    return plan
