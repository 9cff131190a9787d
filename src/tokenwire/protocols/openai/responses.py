"""OpenAI's response, chunk and usage objects from a Plan and its choices' outputs (sans-IO).

Plain dicts, serialized with orjson by the transport: on the streaming path one is built per
choice per engine step.
"""

from __future__ import annotations

from typing import Any

from tokenwire.protocols.openai import chat
from tokenwire.protocols.openai.core import Plan
from tokenwire.protocols.openai.output import ChoiceOutput, Delta, legacy_logprobs


def usage(plan: Plan) -> dict[str, Any]:
    """Prompt tokens count each prompt once (its first choice's), completions every choice's.
    cached_tokens: prompt positions whose KV was reused (session or prefix cache), not computed."""
    n = len(plan.outputs) // len(plan.prompts)
    firsts = [plan.outputs[p * n] for p in range(len(plan.prompts))]
    prompt = sum(o.finish.prompt_tokens for o in firsts if o.finish)
    completion = sum(o.finish.completion_tokens for o in plan.outputs if o.finish)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)},
    }


def _head(plan: Plan, obj: str) -> dict[str, Any]:
    head = {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}
    if plan.session is not None:
        head["session"] = plan.session
    return head


def _readouts(plan: Plan, entries: list[dict[str, Any]]) -> dict[str, Any]:
    assert plan.limits is not None
    return {
        "concepts": list(plan.limits.concept_names),
        "layers": list(plan.limits.concept_layers),
        "tokens": entries,
    }


def chat_message(plan: Plan, out: ChoiceOutput) -> tuple[dict[str, Any], str]:
    """The assistant message and finish_reason of a finished choice."""
    reason = out.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": out.generated, "refusal": None}
    if plan.tool_mode != "none" and not (out.finish and out.finish.reason == "length"):
        calls = chat.parse_tool_calls(plan.tool_mode, plan.tool, out.generated, plan.tool_names)
        if calls:
            message["content"] = None
            message["tool_calls"] = calls
            reason = "tool_calls"
    return message, reason


def chat_response(plan: Plan) -> dict[str, Any]:
    choices = []
    for out in plan.outputs:
        message, reason = chat_message(plan, out)
        choice: dict[str, Any] = {
            "index": out.index,
            "message": message,
            "finish_reason": reason,
            "logprobs": {"content": out.logprobs, "refusal": None} if plan.choices[0][1].logprobs else None,
        }
        if plan.readouts:
            choice["readouts"] = _readouts(plan, out.readouts)
        choices.append(choice)
    return {
        **_head(plan, "chat.completion"),
        "choices": choices,
        "usage": usage(plan),
        "system_fingerprint": None,
    }


def completion_response(plan: Plan) -> dict[str, Any]:
    choices = []
    for out in plan.outputs:
        choice: dict[str, Any] = {
            "index": out.index,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "logprobs": legacy_logprobs(out.logprobs) if out.legacy and plan.choices[0][1].logprobs else None,
        }
        if plan.readouts:
            choice["readouts"] = _readouts(plan, out.readouts)
        choices.append(choice)
    return {
        **_head(plan, "text_completion"),
        "choices": choices,
        "usage": usage(plan),
        "system_fingerprint": None,
    }


def chat_chunk(
    plan: Plan, out: ChoiceOutput, delta: Delta, *, first: bool = False, finished: bool = False
) -> dict[str, Any] | None:
    """One choice's chunk for a batch of events (None when it carries nothing)."""
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
    reason = None
    if finished:
        message, reason = chat_message(plan, out)
        if "tool_calls" in message:
            # tool calls go out whole, once parsed, as index-numbered deltas
            body["tool_calls"] = [dict(call, index=k) for k, call in enumerate(message["tool_calls"])]
            delta.text = ""
    tool_text = plan.tool_mode in ("named", "required")
    if delta.text and not tool_text:
        body["content"] = delta.text
    elif first:
        body["content"] = ""
    if not body and reason is None and not delta.logprobs and not delta.readouts:
        return None
    choice: dict[str, Any] = {
        "index": out.index,
        "delta": body,
        "finish_reason": reason,
        "logprobs": {"content": delta.logprobs, "refusal": None} if delta.logprobs else None,
    }
    if delta.readouts:
        choice["readouts"] = _readouts(plan, delta.readouts)
    return {
        **_head(plan, "chat.completion.chunk"),
        "choices": [choice],
        "system_fingerprint": None,
        **({"usage": None} if plan.include_usage else {}),
    }


def completion_chunk(
    plan: Plan, out: ChoiceOutput, delta: Delta, *, finished: bool = False
) -> dict[str, Any] | None:
    if not delta.text and not finished and not delta.logprobs and not delta.readouts:
        return None
    choice: dict[str, Any] = {
        "index": out.index,
        "text": delta.text,
        "finish_reason": out.finish_reason if finished else None,
        "logprobs": legacy_logprobs(delta.logprobs) if delta.logprobs else None,
    }
    if delta.readouts:
        choice["readouts"] = _readouts(plan, delta.readouts)
    return {
        **_head(plan, "text_completion"),
        "choices": [choice],
        "system_fingerprint": None,
        **({"usage": None} if plan.include_usage else {}),
    }


def usage_chunk(plan: Plan) -> dict[str, Any]:
    obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
    return {**_head(plan, obj), "choices": [], "usage": usage(plan), "system_fingerprint": None}
