"""Chat messages -> prompt tokens through the model's own chat template, and tool calls.

A chat on a session appends only the new messages. Chat templates render whole conversations,
so the new messages are rendered as the continuation of a stand-in conversation (system, user,
assistant) and the text after that conversation is what gets appended; before it come the
tokens that close an assistant turn (ChatML's `<|im_end|>\\n`) minus those the session already
ends with (a reply that ended on EOS has `<|im_end|>` but not the newline). Turn 2 on a session
is then token for token the prompt a client resending the whole history would send.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from tokenwire.model.tokenizer import Tokenizer
from tokenwire.protocols.openai.errors import OpenAIError, bad_request
from tokenwire.protocols.openai.images import ChatImage, ChatVision, read_image_part
from tokenwire.protocols.openai.schemas import ChatCompletionRequest, ChatMessage, Tool

_SENTINEL = "tokenwire-sentinel-a7c3"  # plain words: survives templates that trim content
_STAND_IN = [
    {"role": "system", "content": _SENTINEL},
    {"role": "user", "content": _SENTINEL},
    {"role": "assistant", "content": _SENTINEL},
]


def template_messages(
    messages: Sequence[ChatMessage], vision: ChatVision | None = None, images: list[ChatImage] | None = None
) -> list[dict[str, Any]]:
    """OpenAI messages as the dicts Hugging Face chat templates expect. On a vision model
    (`vision`), image_url parts become their vision blocks and are collected into `images`."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type == "image_url" and vision is not None and images is not None:
                    text, image = read_image_part(part, vision, f"messages.{i}.content.{j}")
                    texts.append(text)
                    images.append(image)
                    continue
                if part.type not in ("text", "input_text") or part.text is None:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported: this model reads text only",
                        param=f"messages.{i}.content.{j}.type",
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {
            # "developer" is OpenAI's newer name for the system role; templates know "system"
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in m.tool_calls
            ]
        out.append(msg)
    return out


def _arguments(text: str) -> Any:
    """Templates index into arguments (`tool_call.arguments | tojson`), so pass a JSON object."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    env = jinja2.Environment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def supports_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template reads the `tools` variable (and so shows tools to the model)."""
    template = tokenizer.hf.chat_template
    return isinstance(template, str) and "tools" in _template_variables(template)


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], gen: bool, tools: Any) -> str:
    kwargs = {"tools": tools} if tools else {}
    try:
        return tokenizer.chat_prompt(messages, add_generation_prompt=gen, **kwargs)
    except Exception as exc:  # a template's raise_exception(): roles out of order, ...
        raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from exc


def prompt_tokens(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], session_tail: Sequence[int], tools: Any = None
) -> list[int]:
    """The tokens to append: the whole templated conversation for a new (empty) session or no
    session, else the continuation after what the session holds (`session_tail`: its last
    tokens, enough to cover a closing sequence)."""
    if not tokenizer.has_chat_template:
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    if not session_tail:
        return tokenizer.encode(_render(tokenizer, messages, True, tools), add_special_tokens=False)
    base = _render(tokenizer, list(_STAND_IN), False, tools)
    full = _render(tokenizer, [*_STAND_IN, *messages], True, tools)
    if not full.startswith(base) or _SENTINEL not in base:
        raise bad_request(
            "this model's chat template does not render a conversation as an extension of its "
            "beginning, so new messages cannot be appended to a session: resend the whole history",
            "session",
        )
    close = tokenizer.encode(base[base.rindex(_SENTINEL) + len(_SENTINEL) :], add_special_tokens=False)
    overlap = next(
        (k for k in range(min(len(close), len(session_tail)), 0, -1) if list(session_tail[-k:]) == close[:k]),
        0,
    )
    return close[overlap:] + tokenizer.encode(full[len(base) :], add_special_tokens=False)


# ---------------------------------------------------------------------------------------- tools
def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_mode(req: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[str, Tool | None]:
    """("none" | "auto" | "required" | "named", the named tool) after checking the request."""
    choice = req.tool_choice
    tools = req.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if not isinstance(choice, str):
        named = next((t for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        return "named", named
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "auto" and not supports_tools(tokenizer):
        raise bad_request(
            "this model's chat template does not support tools, so tool_choice 'auto' cannot work: "
            "use 'required' or a named function (a grammar then makes the model call one) or 'none'",
            "tool_choice",
        )
    return choice, None


def tool_schema(mode: str, named: Tool | None, tools: Sequence[Tool]) -> dict[str, Any] | None:
    """The JSON schema the output must follow: a named function's arguments, or for
    `required` one call `{"name", "arguments"}` of any of the tools."""
    if mode == "named":
        assert named is not None
        return _parameters(named)
    if mode == "required":
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
    return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(mode: str, named: Tool | None, text: str, names: set[str]) -> list[dict[str, Any]]:
    """The tool calls in a finished output. `named` and `required` outputs were produced under
    their grammar, so they parse; an `auto` output is searched for the two forms tool-capable
    templates teach (Qwen/Hermes `<tool_call>{...}</tool_call>`, Llama 3.1 bare
    `{"name", "parameters"}`); anything else is plain content."""
    if mode == "named":
        assert named is not None
        return [_call(named.function.name, text)]
    candidates = _TAGGED.findall(text) if mode == "auto" else [text]
    if mode == "auto" and not candidates and text.strip().startswith("{"):
        candidates = [text.strip()]
    calls = []
    for candidate in candidates:
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            if mode == "required":
                raise OpenAIError(
                    500, "the constrained tool call did not parse", type="server_error"
                ) from None
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(_call(obj["name"], arguments))
    return calls
