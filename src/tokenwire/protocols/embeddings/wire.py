"""OpenAI's embeddings request and response, sans-IO: a parsed JSON body in, a plan out; the
vectors in, the response body out. Errors are OpenAI's 400s naming the field.

Request: `input` (a string, a list of strings, a list of token ids or a list of such lists),
`model` (checked like every route's: absent or the served name), `encoding_format` ("float",
the default, or "base64": each vector's little-endian float32 bytes), `dimensions` (keep the
first N values, re-normalised to unit length) and `user` (ignored).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tokenwire.protocols.embeddings.core import EmbeddingInputError, Embeddings, check_dimensions
from tokenwire.protocols.openai.errors import OpenAIError, bad_request, model_not_found

EncodingFormat = Literal["float", "base64"]
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})


@dataclass
class EmbeddingPlan:
    inputs: list[str | list[int]]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None


def parse_request(body: Any, *, model_name: str, hidden_size: int) -> EmbeddingPlan:
    """The body as a plan, or the OpenAIError (400, 404 for another model) naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "body")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(
            f"{unknown[0]}: unknown field (the embeddings request takes {', '.join(sorted(FIELDS))})",
            unknown[0],
            "unknown_field",
        )
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad_request("model must be a string", "model")
        if model != model_name:
            raise model_not_found(model, model_name)
    if "input" not in body:
        raise bad_request("input is required: a string, a list of strings or token ids", "input")
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format = {fmt!r}: must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    try:
        check_dimensions(dimensions, hidden_size)
    except EmbeddingInputError as exc:
        raise openai_error(exc) from None
    return EmbeddingPlan(parse_input(body["input"]), fmt, dimensions)


def parse_input(value: Any) -> list[str | list[int]]:
    """OpenAI's four forms of `input` as a list of inputs (texts or token id lists)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad_request("input must be a string, a list of strings or token ids", "input")
    if not value:
        raise bad_request("input is empty: give at least one text or token list", "input")
    if isinstance(value[0], int):  # one token array (true/false are not ids)
        bad = next(((j, t) for j, t in enumerate(value) if not _is_id(t)), None)
        if bad is not None:
            raise bad_request(
                f"input[{bad[0]}] = {_short(bad[1])} is not a token id", f"input[{bad[0]}]", "invalid_token"
            )
        return [list(value)]
    inputs: list[str | list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            inputs.append(list(item))
        elif isinstance(item, list):
            j, bad = next((j, t) for j, t in enumerate(item) if not _is_id(t))
            raise bad_request(
                f"input[{i}][{j}] = {bad!r} is not a token id", f"input[{i}][{j}]", "invalid_token"
            )
        else:
            raise bad_request(
                f"input[{i}] = {_short(item)} is neither a string nor a token id list"
                " (a token array holds integers only)",
                f"input[{i}]",
            )
    return inputs


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def openai_error(exc: EmbeddingInputError) -> OpenAIError:
    """An input the engine cannot embed, as OpenAI's 400 naming it."""
    return OpenAIError(400, str(exc), param=exc.param, code=exc.code)


def encode(vector: Sequence[float], fmt: EncodingFormat) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of little-endian float32."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


def decode_base64(text: str) -> list[float]:
    """encode()'s inverse for base64 (what OpenAI's clients do)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


def response(result: Embeddings, plan: EmbeddingPlan, model_name: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v, plan.encoding_format)}
            for i, v in enumerate(result.vectors)
        ],
        "model": model_name,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
