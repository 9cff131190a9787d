"""The sans-IO core of OpenAI's Responses API: request -> chat plan, engine output -> response.

A Responses request is planned as the chat completion it amounts to (openai/core.plan_chat), so
the chat template, tool calls, `text.format` constraints, sampling and admission checks are
chat's own: `input` items become chat messages (items_to_messages), `instructions` a system
message, `max_output_tokens` chat's max_completion_tokens, `text.format` its response_format.
A chat error names chat's field; it is renamed to the Responses field (`messages` -> `input`).

Everything here works on plain values (the validated body, token lists, the model's limits);
routes.py moves them between HTTP, the store and the engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenwire.protocols.openai import core as chat_core
from tokenwire.protocols.openai import responses as chat_responses
from tokenwire.protocols.openai.errors import OpenAIError, bad_request
from tokenwire.protocols.openai.schemas import ChatCompletionRequest
from tokenwire.protocols.responses.schemas import ResponseCreate

# chat's field names -> the Responses request's, in the errors plan_chat raises
RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------------- input items
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"{where}.{j}: content part type {kind!r} is not supported (text only: input_text)",
                f"{where}.{j}.type",
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise bad_request(f"{where}.{j}.text: a string", f"{where}.{j}.text")
        texts.append(text)
    return "".join(texts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name}: a string is required", f"{where}.{name}")
    return value


def input_items(body: ResponseCreate) -> list[dict[str, Any]]:
    """`input` as OpenAI's stored input items (each with an id), checked item by item."""
    if isinstance(body.input, str):
        return [_message("user", body.input)]
    items = []
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role: one of {', '.join(ROLES)}", f"{where}.role")
            items.append(_message(role, _text_of(item.get("content"), f"{where}.content"), item.get("id")))
        elif kind == "function_call":
            arguments = _field(item, "arguments", where)
            items.append(
                {
                    "id": item.get("id") or new_id("fc"),
                    "type": "function_call",
                    "call_id": _field(item, "call_id", where),
                    "name": _field(item, "name", where),
                    "arguments": arguments,
                    "status": "completed",
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            items.append(
                {
                    "id": item.get("id") or new_id("fco"),
                    "type": "function_call_output",
                    "call_id": _field(item, "call_id", where),
                    "output": text,
                    "status": "completed",
                }
            )
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                f"{where}.type",
            )
    if not items:
        raise bad_request("input is empty", "input")
    return items


def _message(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    part = (
        {"type": "output_text", "text": text, "annotations": []}
        if role == "assistant"
        else {"type": "input_text", "text": text}
    )
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": role,
        "content": [part],
        "status": "completed",
    }


def items_to_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls become one assistant message
    with tool_calls, a function_call_output a `tool` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": _text_of(item["content"], "input")})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


# ----------------------------------------------------------------------------------- planning
@dataclass
class Turn:
    """One response being made: its plan, the request, and what it is built from."""

    id: str
    body: ResponseCreate
    plan: chat_core.Plan
    items: list[dict[str, Any]]  # this request's input items
    history: list[dict[str, Any]]  # earlier turns' items (previous_response_id's chain)
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    call_item_id: str = field(default_factory=lambda: new_id("fc"))  # a named function's call
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"

    @property
    def out(self) -> Any:
        return self.plan.outputs[0]


def _renamed(exc: OpenAIError) -> OpenAIError:
    param = exc.param
    for old, new in RENAMED.items():
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old) :]
    message = exc.message
    for old, new in RENAMED.items():
        message = message.replace(old, new)
    return OpenAIError(exc.status, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def chat_request(body: ResponseCreate, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request this Responses request amounts to."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "top_k": body.top_k,
        "priority": body.priority,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            rf["json_schema"] = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        fields["response_format"] = rf
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise _renamed(bad_request(f"{where}: {first.get('msg')}", where or "input")) from None


def plan_turn(
    body: ResponseCreate,
    limits: chat_core.ModelLimits,
    previous: dict[str, Any] | None,
    history: Sequence[dict[str, Any]],
    session_tokens: Sequence[int] | None,
) -> Turn:
    """Plan a response. `previous`: the previous response's object (previous_response_id), whose
    session holds `session_tokens`; its output items sent again in `input` (by id, or a
    function call by call_id) are not repeated: the session already holds them. `history`: the
    items of the chain before this turn."""
    items = input_items(body)
    earlier = (previous or {}).get("output", ())
    calls = {o["call_id"] for o in earlier if o["type"] == "function_call"}
    ids = {o["id"] for o in earlier}
    new = [
        i
        for i in items
        if i["id"] not in ids and not (i["type"] == "function_call" and i["call_id"] in calls)
    ]
    messages = items_to_messages(new)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise bad_request("input adds nothing to the previous response", "input")
    request = chat_request(body, messages)
    try:
        plan = chat_core.plan_chat(request, limits, session_tokens)
    except OpenAIError as exc:
        raise _renamed(exc) from None
    return Turn(new_id("resp"), body, plan, items, list(history))


# ----------------------------------------------------------------------------------- results
def finish(turn: Turn) -> list[dict[str, Any]]:
    """The output items of a finished turn (function calls, or one assistant message) and its
    status: `incomplete` when max_output_tokens cut it (a named function's call then has the
    arguments so far, status `incomplete`; any other cut output is a message)."""
    out = turn.out
    cut = out.finish is not None and out.finish.reason == "length"
    status = "incomplete" if cut else "completed"
    turn.status = status
    if turn.plan.tool_mode == "named":  # the output is the call's arguments (streamed as they come)
        turn.output = [call_item(turn, out.generated, status)]
        return turn.output
    message, _ = chat_responses.chat_message(turn.plan, out)
    if message.get("tool_calls"):
        turn.output = [
            {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            for call in message["tool_calls"]
        ]
    else:
        turn.output = [
            {
                "id": turn.message_id,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [
                    {"type": "output_text", "text": out.generated, "annotations": [], "logprobs": []}
                ],
            }
        ]
    return turn.output


def call_item(turn: Turn, arguments: str, status: str) -> dict[str, Any]:
    """The function call of a turn whose tool_choice names the function."""
    return {
        "id": turn.call_item_id,
        "type": "function_call",
        "call_id": turn.call_id,
        "name": turn.plan.tool.function.name,
        "arguments": arguments,
        "status": status,
    }


def usage(turn: Turn) -> dict[str, Any]:
    """input_tokens: the whole sequence before generation (earlier turns included); cached_tokens:
    its positions whose KV was reused (the previous response's session, or the prefix cache)."""
    u = chat_responses.usage(turn.plan)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _tool_choice(body: ResponseCreate) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def response_object(turn: Turn, *, with_output: bool = True) -> dict[str, Any]:
    body = turn.body
    fmt = body.text.format if body.text and body.text.format else None
    done = turn.status != "in_progress"
    return {
        "id": turn.id,
        "object": "response",
        "created_at": turn.created_at,
        "status": turn.status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if turn.status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": turn.plan.model,
        "output": turn.output if with_output else [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": _tool_choice(body),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": usage(turn) if done else None,
        "user": body.user,
        "metadata": body.metadata or {},
    }
