"""The tokenizer endpoints' bodies to answers, sans-IO: the model's Tokenizer in, a dict out,
an OpenAIError (400 naming the field; 404 for another model) for a bad body.

/tokenize takes two forms:
  llama-server's {"content": str, "add_special": false, "with_pieces": false}
    -> {"tokens": [id, ...]}, or with pieces {"tokens": [{"id": id, "piece": str}, ...]} (a piece
    that is not whole UTF-8 by itself, a part of a character, is its list of byte values);
  vLLM's {"prompt": str, "add_special_tokens": true, "return_token_strs": false} or its chat form
    {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
    -> {"tokens": [...], "count": n, "max_model_len": N} (+ "token_strs").
/detokenize: {"tokens": [id, ...]} -> {"content": text, "prompt": text} (llama-server's and
  vLLM's key, the same text: special tokens included, as both servers do).
/apply-template: {"messages": [...], "add_generation_prompt": true} -> {"prompt": text}, the
  messages (OpenAI's chat shape) rendered with the model's own chat template.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from tokenwire.model.tokenizer import Tokenizer, check_text
from tokenwire.protocols.openai.chat import template_messages
from tokenwire.protocols.openai.errors import OpenAIError, bad_request, model_not_found
from tokenwire.protocols.openai.schemas import ChatMessage

_MESSAGES: TypeAdapter[list[ChatMessage]] = TypeAdapter(list[ChatMessage])


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "body")
    return body


def _check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        if not isinstance(model, str):
            raise bad_request("model must be a string", "model")
        raise model_not_found(model, model_name)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, not {value!r}", name)
    return value


def _text(body: dict[str, Any], name: str) -> str:
    value = body[name]
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", name)
    try:
        check_text(value, name)
    except ValueError as exc:
        raise bad_request(str(exc), name) from None
    return value


def piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """A token's text, or its byte values where they are not whole UTF-8 (llama-server's rule)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def render_messages(tokenizer: Tokenizer, messages: Any, add_generation_prompt: bool = True) -> str:
    """OpenAI chat messages through the model's chat template, as the chat route renders them."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of chat messages", "messages")
    try:
        parsed = _MESSAGES.validate_python(messages)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and "[" in p))
        raise bad_request(f"messages.{where}: {first['msg']}", f"messages.{where}") from None
    if not tokenizer.has_chat_template:
        raise bad_request("this model has no chat template", "messages")
    try:
        return tokenizer.chat_prompt(template_messages(parsed), add_generation_prompt=add_generation_prompt)
    except OpenAIError:
        raise
    except Exception as exc:  # the template's raise_exception(): roles out of order, ...
        raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from exc


def tokenize(body: Any, tokenizer: Tokenizer, *, model_name: str, max_model_len: int) -> dict[str, Any]:
    body = _object(body)
    _check_model(body, model_name)
    forms = [name for name in ("content", "prompt", "messages") if name in body]
    if len(forms) != 1:
        raise bad_request(
            "give exactly one of content (llama-server), prompt or messages (vLLM)"
            + (f"; this body has {' and '.join(forms)}" if forms else ""),
            forms[1] if len(forms) > 1 else "content",
        )
    if forms[0] == "content":
        ids = tokenizer.encode(_text(body, "content"), add_special_tokens=_flag(body, "add_special", False))
        if _flag(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": piece(tokenizer, t)} for t in ids]}
        return {"tokens": ids}
    if forms[0] == "prompt":
        text = _text(body, "prompt")
        ids = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        gen = _flag(body, "add_generation_prompt", True)
        text = render_messages(tokenizer, body["messages"], gen)
        ids = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.hf.convert_ids_to_tokens(ids)
    return out


def token_ids(value: Any, vocab_size: int, field: str = "tokens") -> list[int]:
    """A list of token ids in [0, vocab_size), or the 400 naming the first bad one."""
    if not isinstance(value, list):
        raise bad_request(f"{field} must be a list of token ids", field)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise bad_request(
                f"{field}[{i}] = {t!r} is not a token id of this model: ids are in [0, {vocab_size})",
                f"{field}[{i}]",
                "invalid_token",
            )
    return value


def detokenize(body: Any, tokenizer: Tokenizer, *, model_name: str) -> dict[str, Any]:
    body = _object(body)
    _check_model(body, model_name)
    if "tokens" not in body:
        raise bad_request("tokens is required: a list of token ids", "tokens")
    text = tokenizer.decode(token_ids(body["tokens"], tokenizer.vocab_size))
    return {"content": text, "prompt": text}


def apply_template(body: Any, tokenizer: Tokenizer, *, model_name: str) -> dict[str, Any]:
    body = _object(body)
    _check_model(body, model_name)
    if "messages" not in body:
        raise bad_request("messages is required: a list of chat messages", "messages")
    gen = _flag(body, "add_generation_prompt", True)
    return {"prompt": render_messages(tokenizer, body["messages"], gen)}
