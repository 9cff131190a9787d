"""/api/embed and the older /api/embeddings, through the embeddings module's pooling
(protocols/embeddings: the model's declared pooling, unit-length vectors); nothing is pooled
here. `/api/embed` takes `input` (a text or a list of texts), `truncate` (default true: inputs
over the context are cut) and `dimensions`; `/api/embeddings` takes one `prompt`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import Origin
from tokenwire.protocols.embeddings.core import EmbeddingInputError, embed_counted
from tokenwire.protocols.ollama.core import check_model
from tokenwire.protocols.ollama.errors import OllamaError, bad_request, from_engine_error
from tokenwire.protocols.ollama.options import parse_options
from tokenwire.protocols.openai.runner import on_disconnect

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits


@dataclass
class EmbedRequest:
    model: str
    inputs: list[str]
    truncate: bool
    dimensions: int | None
    legacy: bool  # /api/embeddings: one `prompt`, answered as {"embedding": [...]}


def parse_embed(body: Any, limits: ModelLimits, *, legacy: bool) -> EmbedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = check_model(body, limits)
    parse_options(body.get("options"))  # checked like generation's; none changes an embedding
    raw = body.get("prompt") if legacy else body.get("input")
    if raw is None or raw == "":
        inputs: list[str] = []
    elif isinstance(raw, str):
        inputs = [raw]
    elif not legacy and isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        inputs = list(raw)
    else:
        raise bad_request(
            "prompt must be a string" if legacy else "input must be a string or a list of strings"
        )
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad_request("truncate must be true or false")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise bad_request("dimensions must be an integer")
    return EmbedRequest(model, inputs, truncate, dimensions, legacy)


def embed_response(
    req: EmbedRequest, vectors: list[list[float]], prompt_tokens: int, duration_ns: int
) -> dict[str, Any]:
    if req.legacy:
        return {"embedding": vectors[0] if vectors else []}
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": duration_ns,
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
    }


async def run_embed(engine: EngineAPI, req: EmbedRequest, request: Request, started: int) -> dict[str, Any]:
    """The vectors (none for no input: Ollama's answer to a load), cancelled if the client
    goes away; errors in Ollama's shape."""
    if not req.inputs:
        return embed_response(req, [], 0, time.perf_counter_ns() - started)
    peer = f"{request.client.host}:{request.client.port}" if request.client else None
    origin = Origin("ollama", "embeddings" if req.legacy else "embed", peer)
    work = asyncio.ensure_future(
        embed_counted(
            engine,
            req.inputs,
            dimensions=req.dimensions,
            truncate=req.truncate,
            field="prompt" if req.legacy else "input",
            origin=origin,
        )
    )
    watcher = asyncio.create_task(on_disconnect(request, work.cancel))
    try:
        result = await work
    except EmbeddingInputError as exc:
        raise bad_request(str(exc)) from None
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    except asyncio.CancelledError:
        if not watcher.done():
            raise  # the server itself cancels this request
        raise OllamaError(499, "the client closed the request") from None
    except (OSError, RuntimeError, ValueError) as exc:  # the model call failed: the server's fault
        raise OllamaError(500, f"embedding failed: {exc}") from exc
    finally:
        watcher.cancel()
        work.cancel()
    return embed_response(req, result.vectors, result.prompt_tokens, time.perf_counter_ns() - started)
