"""The sans-IO core of Anthropic's Messages API.

A request becomes the OpenAI side's chat request (system prompt and content blocks as chat
messages, tool_use/tool_result blocks as tool calls and tool messages, tools and tool_choice as
OpenAI's) and is planned by its core (protocols/openai/core.plan_chat): the chat template, the
tool-call grammar, images, the engine's sampling rules and admission are one code path for both
APIs, and the same conversation gives the same tokens through either. The finished output is
read back through the same tool-call parser (responses.chat_message) into Anthropic's blocks.

Everything here works on plain values and raises AnthropicError; routes.py does the I/O.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenwire.engine.errors import InvalidRequestError
from tokenwire.engine.request import Event
from tokenwire.protocols.anthropic.errors import AnthropicError, from_openai, invalid
from tokenwire.protocols.anthropic.schemas import Block, CountTokensRequest, MessagesRequest
from tokenwire.protocols.openai import chat, core, responses
from tokenwire.protocols.openai.core import ModelLimits, Plan
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.output import ChoiceOutput
from tokenwire.protocols.openai.schemas import ChatCompletionRequest

M = TypeVar("M", bound=BaseModel)
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


# ------------------------------------------------------------------------------- requests
def parse(model: type[M], body: Any) -> M:
    """A JSON body as `model`, or a 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(_validation_message(exc)) from None


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    message = f"{_loc(first.get('loc', ()))}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (also invalid: {', '.join(_loc(e.get('loc', ())) for e in errors[1:4])})"
    return message


def _loc(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a dotted field, without the union members pydantic inserts
    (`str`, `list[Block]`, ...)."""
    names = ("str", "int", "float", "bool", "dict")
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in names))) or "body"


def _text(blocks: str | list[Block] | None, where: str) -> str:
    """A string or a list of text blocks (the system prompt, a tool result) as one string."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise invalid(f"{where}.{j}: a {block.type!r} block here is not supported, only text")
    return "".join(block.text or "" for block in blocks)


def _image(block: Block, where: str, limits: ModelLimits) -> dict[str, Any]:
    """An image block as the OpenAI side's image_url part (read by protocols/openai/images.py)."""
    if limits.vision is None:
        raise invalid(f"{where}: image blocks need a vision model; {limits.name} reads text only")
    source = block.source or {}
    if source.get("type") != "base64":
        raise invalid(
            f"{where}.source: only base64 images are read (type {source.get('type')!r}): this server "
            "does not fetch remote images or files"
        )
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise invalid(f"{where}.source: a base64 image needs media_type and data (strings)")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _messages(req: CountTokensRequest, limits: ModelLimits) -> list[dict[str, Any]]:
    """Anthropic's system prompt and messages as OpenAI chat messages: a user turn's
    tool_result blocks become `tool` messages (before its other blocks, where Anthropic puts
    them), an assistant turn's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text" and block.text is not None:
                parts.append({"type": "text", "text": block.text})
            elif block.type == "image" and message.role == "user":
                parts.append(_image(block, where, limits))
            elif block.type == "tool_result" and message.role == "user" and block.tool_use_id:
                result = _text(block.content, f"{where}.content")
                content = f"Error: {result}" if block.is_error else result  # the template has no flag
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            elif block.type == "tool_use" and message.role == "assistant" and block.name:
                arguments = json.dumps(block.input or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            else:
                raise invalid(f"{where}: a {block.type!r} block is not supported in a {message.role} message")
        if parts or calls:
            out.append(
                {"role": message.role, "content": parts or None, **({"tool_calls": calls} if calls else {})}
            )
    return out


def _chat_body(req: CountTokensRequest, limits: ModelLimits) -> dict[str, Any]:
    """The OpenAI chat request's fields for this conversation (its tools and tool_choice too)."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise invalid("thinking: extended thinking is not supported by this server")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req, limits)}
    if req.messages[-1].role == "assistant":
        # a prefilled answer would have to continue the assistant's turn the template closes
        raise invalid("messages: the last message must be a user message (prefill is not supported)")
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    output = req.output_config.format if req.output_config else None
    if output is not None:  # Anthropic's structured outputs: OpenAI's response_format json_schema
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output.json_schema},
        }
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise invalid("tool_choice.name: a tool_choice of type 'tool' names the tool")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = _TOOL_CHOICE[choice.type]
    return body


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a value the OpenAI side refuses that ours let through
        raise invalid(_validation_message(exc)) from None


def plan_messages(req: MessagesRequest, limits: ModelLimits) -> Plan:
    """The engine plan of a Messages request (one choice), checked end to end by the OpenAI
    core and the engine's admission before anything runs."""
    body = _chat_body(req, limits)
    body.update(max_tokens=req.max_tokens, stream=req.stream)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    request = _chat_request(body)
    # Anthropic allows more stop strings than OpenAI's 4 (schemas.MAX_STOP_SEQUENCES)
    request.stop = list(req.stop_sequences or [])
    try:
        plan = core.plan_chat(request, limits, None)
    except OpenAIError as exc:
        raise from_openai(exc) from None
    plan.id = f"msg_{uuid.uuid4().hex[:24]}"
    return plan


def count_tokens(req: CountTokensRequest, limits: ModelLimits) -> int:
    """The prompt the same conversation would be, in tokens (tools included where the chat
    template shows them; an image as its vision block)."""
    request = _chat_request(_chat_body(req, limits))
    try:
        core.check_model(request.model, limits)
        messages = chat.template_messages(request.messages, limits.vision, [])
        tools = chat.tool_dicts(request.tools) if request.tools and request.tool_choice != "none" else None
        return len(chat.prompt_tokens(limits.tokenizer, messages, [], tools))
    except OpenAIError as exc:
        raise from_openai(exc) from None
    except InvalidRequestError as exc:  # text that is not valid Unicode
        raise invalid(f"messages: {exc}") from None


# ------------------------------------------------------------------------------ responses
def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # only a free-form ("auto") call can fail; it is not a call then
        value = None
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": value if isinstance(value, dict) else {"value": value},
    }


def result(plan: Plan, out: ChoiceOutput) -> tuple[list[dict[str, Any]], str, str | None]:
    """A finished output's content blocks, stop_reason and stop_sequence."""
    message, _ = responses.chat_message(plan, out)
    blocks: list[dict[str, Any]] = []
    if message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    blocks += [_tool_use(call) for call in message.get("tool_calls", ())]
    assert out.finish is not None
    if "tool_calls" in message:
        return blocks, "tool_use", None
    if out.finish.reason == "length":
        return blocks, "max_tokens", None
    if out.finish.reason == "stop" and out.matcher is not None and out.matcher.done:
        return blocks, "stop_sequence", out.matcher.matched
    return blocks, "end_turn", None


def usage(plan: Plan) -> dict[str, Any]:
    """Anthropic counts input as uncached + cache reads + cache writes: the prompt positions the
    prefix cache (or nothing) supplied are cache reads; nothing is a cache write here."""
    counts = responses.usage(plan)
    cached = counts["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": counts["prompt_tokens"] - cached,
        "output_tokens": counts["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _message(
    plan: Plan, content: list[dict[str, Any]], reason: str | None, sequence: str | None
) -> dict[str, Any]:
    return {
        "id": plan.id,
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
    }


def message_response(plan: Plan) -> dict[str, Any]:
    blocks, reason, sequence = result(plan, plan.outputs[0])
    return {**_message(plan, blocks, reason, sequence), "usage": usage(plan)}


class EventStream:
    """Engine events -> Anthropic's stream events (dicts with their `type`). Plain text streams
    as text_delta; a named tool's arguments (a grammar makes the output exactly them) stream as
    input_json_delta; `auto`/`any` outputs are only known to be calls once finished, so their
    blocks go out whole at the end, as the non-streaming answer has them."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.out = plan.outputs[0]
        self.blocks = 0  # blocks started so far (the next one's index)
        self.open = False

    def start(self) -> list[dict[str, Any]]:
        """message_start (input_tokens: the prompt; the cache reads are known at the end, in
        message_delta's cumulative usage) and a ping."""
        counts = {
            "input_tokens": sum(len(p) for p in self.plan.prompts),
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        message = {**_message(self.plan, [], None, None), "usage": counts}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        delta = self.out.feed(event)
        events: list[dict[str, Any]] = []
        mode = self.plan.tool_mode
        if delta.text and mode == "none":
            if not self.open:
                events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": delta.text}))
        elif delta.text and mode == "named":
            if not self.open:
                assert self.plan.tool is not None
                name = self.plan.tool.function.name
                block = {
                    "type": "tool_use",
                    "id": f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": name,
                    "input": {},
                }
                events.append(self._start(block))
            events.append(self._delta({"type": "input_json_delta", "partial_json": delta.text}))
        if self.out.finish is event:
            events += self._finish()
        return events

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.open = True
        self.blocks += 1
        return {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _stop(self) -> dict[str, Any]:
        self.open = False
        return {"type": "content_block_stop", "index": self.blocks - 1}

    def _finish(self) -> list[dict[str, Any]]:
        blocks, reason, sequence = result(self.plan, self.out)
        events = []
        if self.open:
            events.append(self._stop())
        elif self.plan.tool_mode != "none":  # nothing streamed: the blocks whole
            for block in blocks:
                if block["type"] == "text":
                    events += [
                        self._start({"type": "text", "text": ""}),
                        self._delta({"type": "text_delta", "text": block["text"]}),
                    ]
                else:
                    partial = json.dumps(block["input"], ensure_ascii=False)
                    events += [
                        self._start({**block, "input": {}}),
                        self._delta({"type": "input_json_delta", "partial_json": partial}),
                    ]
                events.append(self._stop())
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(self.plan),
            }
        )
        events.append({"type": "message_stop"})
        return events


def error_event(exc: AnthropicError) -> dict[str, Any]:
    """A failure after the stream's 200: Anthropic's `error` event, its error object as a body."""
    return exc.body()
