"""The sans-IO core of Ollama's API: request bodies (plain JSON values) -> engine plans.

Bodies are parsed here, not by FastAPI, so every refusal is Ollama's `{"error": ...}` with a
4xx (errors.py). A plan is the OpenAI side's core.Plan, run by the same runner (runner.py), so
admission, cancellation and metrics behave alike; the chat template, tool calls and grammars are
the OpenAI side's too (chat.py, sampling.py). reply.py turns the engine's events into Ollama's
objects.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from pydantic import ValidationError

from tokenwire.engine.admission import check_request
from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import GenerateOptions, InvalidValueError, require_int
from tokenwire.protocols.ollama.errors import (
    bad_request,
    from_engine_error,
    from_openai,
    model_not_found,
)
from tokenwire.protocols.ollama.options import Options, parse_options, room
from tokenwire.protocols.openai import chat
from tokenwire.protocols.openai.core import SESSION_TAIL, ModelLimits, Plan
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.output import ChoiceOutput
from tokenwire.protocols.openai.sampling import PenaltyConstraint, Structure, compile_structure
from tokenwire.protocols.openai.schemas import Tool

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
# the engine's field names -> Ollama's, in the engine's messages
NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_k": "options.top_k",
    "top_p": "options.top_p",
    "seed": "options.seed",
}


@dataclass
class Request:
    """One /api/chat or /api/generate request, planned. `plan` is None for a request with
    nothing to generate (no prompt, no messages), which Ollama answers as a model load."""

    kind: str  # "chat" | "generate"
    model: str  # as the client named it (echoed back)
    stream: bool
    plan: Plan | None
    keep_alive: Any = None
    prompt: list[int] = field(default_factory=list)  # the whole prompt (generate's `context`)
    tool_mode: str = "none"
    tool_names: set[str] = field(default_factory=set)


def served_name(limits: ModelLimits) -> str:
    """The model as Ollama lists it: name:tag."""
    return f"{limits.name}:latest"


def check_model(body: dict[str, Any], limits: ModelLimits) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise bad_request("model is required")
    if not isinstance(model, str):
        raise bad_request("model must be a string")
    if model not in (limits.name, served_name(limits)):
        raise model_not_found(model)
    return model


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}")
    return value


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string")
    return value


def _common(body: Any, limits: ModelLimits) -> tuple[str, bool, Options]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = check_model(body, limits)
    think = body.get("think")
    if think not in (None, False):
        raise bad_request(f'"{model}" does not support thinking')
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and (
        isinstance(keep_alive, bool) or not isinstance(keep_alive, str | int | float)
    ):
        raise bad_request('keep_alive must be a duration (a string such as "5m" or a number of seconds)')
    return model, _flag(body, "stream", True), parse_options(body.get("options"))


def structure_of(fmt: Any) -> Structure | None:
    """`format`: "" or absent (free text), "json" (a JSON object) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return Structure("json_schema", {"type": "object"}, "format")
    if isinstance(fmt, dict):
        return Structure("json_schema", fmt, "format")
    raise bad_request(f'format must be "json" or a JSON schema, got {fmt!r}')


def _logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    want = _flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    try:
        top = 0 if top is None else require_int(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    except InvalidValueError as exc:
        raise bad_request(str(exc)) from None
    if top and not want:
        raise bad_request("top_logprobs needs logprobs: true")
    return want, top


def _options(
    body: dict[str, Any], opts: Options, limits: ModelLimits, prompt_len: int, structure: Structure | None
) -> GenerateOptions:
    try:
        constraint = compile_structure(structure, limits.tokenizer.hf, limits.logits_size)
    except OpenAIError as exc:
        raise bad_request(f"format: {exc.message}") from None
    if opts.presence_penalty or opts.frequency_penalty:
        constraint = PenaltyConstraint(
            limits.logits_size, opts.presence_penalty, opts.frequency_penalty, constraint
        )
    logprobs, top = _logprobs(body)
    return GenerateOptions(
        max_tokens=room(opts, prompt_len, limits.max_model_len),
        sampling=opts.sampling,
        stop=opts.stop,
        logprobs=logprobs,
        top_logprobs=top,
        constraint=constraint,
    )


def _plan(
    kind: str, limits: ModelLimits, prompt: list[int], options: GenerateOptions, opts: Options, stream: bool
) -> Plan:
    """The engine's own admission rules (numbers, vocabulary, context, KV budget) before
    anything runs; a refusal names Ollama's field."""
    names = {**NAMES, "append": "messages" if kind == "chat" else "prompt"}
    try:
        check_request(limits.engine, len(prompt), prompt, options, names=names, needs_room=True)
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    output = ChoiceOutput(
        0, limits.tokenizer, limits.eos_ids, stops=opts.stop, ignore_eos=False, legacy_logprobs=False
    )
    return Plan(
        "chat" if kind == "chat" else "text",
        limits.name,
        None,
        [prompt],
        [(0, options)],
        [output],
        stream,
        False,
        id=f"ollama-{uuid.uuid4().hex}",
        limits=limits,
    )


# ---------------------------------------------------------------------------------- /api/chat
def _tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be a list")
    try:
        return [Tool.model_validate({"type": "function", **t} if isinstance(t, dict) else t) for t in raw]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"tools.{where}: {first.get('msg', 'invalid value')}") from None


def template_messages(raw: Any) -> list[dict[str, Any]]:
    """Ollama's messages as the dicts chat templates read (the OpenAI side's form)."""
    if not isinstance(raw, list):
        raise bad_request("messages must be a list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: this model reads text only")
        msg: dict[str, Any] = {"role": role, "content": _text(m, "content")}
        if isinstance(m.get("tool_name"), str):
            msg["name"] = m["tool_name"]
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = (
                [_template_call(i, j, c) for j, c in enumerate(calls)] if isinstance(calls, list) else []
            )
        out.append(msg)
    return out


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls[{j}] needs a function with a name")
    arguments = function.get("arguments") or {}
    return {
        "id": f"call_{j}",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def plan_chat(body: Any, limits: ModelLimits) -> Request:
    model, stream, opts = _common(body, limits)
    messages = template_messages(body.get("messages") or [])
    tools = _tools(body.get("tools"))
    structure = structure_of(body.get("format"))
    request = Request("chat", model, stream, None, body.get("keep_alive"))
    if not messages:
        return request
    tok = limits.tokenizer
    mode = "none"
    if tools:
        try:
            mode, _ = chat.tool_mode(cast(Any, SimpleNamespace(tool_choice=None, tools=tools)), tok)
        except OpenAIError:
            raise bad_request(f'"{model}" does not support tools') from None
        request.tool_mode, request.tool_names = mode, {t.function.name for t in tools}
    try:
        prompt = chat.prompt_tokens(tok, messages, [], chat.tool_dicts(tools) if tools else None)
    except OpenAIError as exc:
        raise from_openai(exc) from None
    except EngineError as exc:  # text the tokenizer refuses (a lone surrogate)
        raise bad_request(f"messages: {exc}") from None
    request.prompt = prompt
    request.plan = _plan(
        "chat", limits, prompt, _options(body, opts, limits, len(prompt), structure), opts, stream
    )
    return request


# ------------------------------------------------------------------------------ /api/generate
def _context(raw: Any, limits: ModelLimits) -> list[int]:
    """generate's `context`: the tokens a previous reply returned, to continue from."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("context must be a list of token ids")
    if len(raw) > limits.max_model_len:
        raise bad_request(
            f"context has {len(raw)} tokens, more than the model's context ({limits.max_model_len})"
        )
    try:
        return [require_int(t, "context", 0, limits.vocab_size - 1, what="context: a token id") for t in raw]
    except InvalidValueError as exc:
        raise bad_request(str(exc)) from None


def generate_tokens(
    limits: ModelLimits, prompt: str, system: str, raw: bool, context: Sequence[int]
) -> list[int]:
    """The whole prompt: `context` then the new text. Without `raw` the text goes through the
    model's chat template as a user turn (after `system`), rendered as the continuation of the
    conversation `context` holds; raw text is tokenized as is (special tokens only at the start)."""
    tok = limits.tokenizer
    try:
        if raw or not tok.has_chat_template:
            text = prompt if raw or not system else f"{system}\n\n{prompt}"
            return [*context, *tok.encode(text, add_special_tokens=not context)]
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return [*context, *chat.prompt_tokens(tok, messages, list(context)[-SESSION_TAIL:])]
    except OpenAIError as exc:
        raise from_openai(exc) from None
    except EngineError as exc:
        raise bad_request(f"prompt: {exc}") from None


def plan_generate(body: Any, limits: ModelLimits) -> Request:
    model, stream, opts = _common(body, limits)
    for name in ("template", "suffix"):
        if _text(body, name):
            raise bad_request(f"{name} is not supported by this server: send a raw prompt instead")
    if body.get("images"):
        raise bad_request("images: this model reads text only")
    prompt, system = _text(body, "prompt"), _text(body, "system")
    raw = _flag(body, "raw", False)
    context = _context(body.get("context"), limits)
    structure = structure_of(body.get("format"))
    request = Request("generate", model, stream, None, body.get("keep_alive"))
    if not prompt and not context:
        return request
    tokens = generate_tokens(limits, prompt, system, raw, context)
    request.prompt = tokens
    options = _options(body, opts, limits, len(tokens), structure)
    request.plan = _plan("generate", limits, tokens, options, opts, stream)
    return request
