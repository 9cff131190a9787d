"""POST /v1/embeddings on the OpenAI API's port: the body through wire.py, the inputs through
core.embed_counted, the answer in OpenAI's shape. A client that goes away cancels the work (no
further slice starts; the one running stops before its next layer)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import Origin
from tokenwire.protocols.embeddings import wire
from tokenwire.protocols.embeddings.core import EmbeddingInputError, embed_counted, pooling_for
from tokenwire.protocols.openai.errors import OpenAIError, from_engine
from tokenwire.protocols.openai.runner import on_disconnect
from tokenwire.protocols.tokenizer_api.routes import PATHS as TOKENIZER_PATHS
from tokenwire.protocols.tokenizer_api.routes import add_tokenizer_routes, read_json

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.openai.core import ModelLimits

__all__ = ["add_routes", "pooling_for"]  # pooling_for: transport.py's model card


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def add_routes(
    app: FastAPI,
    engine: EngineAPI,
    limits: ModelLimits,
    check_capacity: Callable[[], None] | None = None,
    guard_paths: Callable[[str], None] | None = None,
) -> None:
    """Issue 43's routes on the OpenAI API's app: POST /v1/embeddings and the tokenizer
    endpoints (/tokenize, /detokenize, /apply-template: protocols/tokenizer_api).
    `check_capacity`: the API's --max-queued check; `guard_paths`: transport.py's, given here
    (importing it would make a cycle), puts the tokenizer paths behind the API key as /v1 is."""
    add_embedding_routes(app, engine, limits, check_capacity)
    add_tokenizer_routes(app, engine)
    if guard_paths is not None:
        for path in TOKENIZER_PATHS:
            guard_paths(path)


def add_embedding_routes(
    app: FastAPI, engine: EngineAPI, limits: ModelLimits, check_capacity: Callable[[], None] | None = None
) -> None:
    """POST /v1/embeddings, bound to `engine` (`check_capacity`: the API's --max-queued check)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings: unit vectors of the model's pooled final hidden states."""
        plan = wire.parse_request(
            await read_json(request), model_name=limits.name, hidden_size=engine.config.hidden_size
        )
        if check_capacity is not None:
            check_capacity()
        peer = f"{request.client.host}:{request.client.port}" if request.client else None
        work = asyncio.ensure_future(
            embed_counted(
                engine, plan.inputs, dimensions=plan.dimensions, origin=Origin("openai", "embeddings", peer)
            )
        )
        watcher = asyncio.create_task(on_disconnect(request, work.cancel))
        try:
            result = await work
        except EmbeddingInputError as exc:
            raise wire.openai_error(exc) from None
        except EngineError as exc:
            raise from_engine(exc, "input") from exc
        except asyncio.CancelledError:
            if not watcher.done():
                raise  # the server itself cancels this request
            raise OpenAIError(499, "the client closed the request", code="client_closed") from None
        except (OSError, RuntimeError, ValueError) as exc:  # the model call failed: our fault
            raise OpenAIError(
                500, f"embedding failed: {exc}", type="server_error", code="engine_error"
            ) from exc
        finally:
            watcher.cancel()
            work.cancel()
        return _json(wire.response(result, plan, limits.name))
