"""POST /tokenize, /detokenize and /apply-template on the OpenAI API's port (core.py has the
bodies). The API key guards them as it guards /v1 (OpenAI's 401); errors are OpenAI's shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenwire.protocols.openai.errors import bad_request
from tokenwire.protocols.tokenizer_api import core

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

# guarded by the API key as /v1 is (embeddings/routes.py passes them to transport.guard_paths)
PATHS = ("/tokenize", "/detokenize", "/apply-template")


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


async def read_json(request: Request) -> Any:
    """The request's body as JSON, or OpenAI's 400 saying why not."""
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", "body") from None


def add_tokenizer_routes(app: FastAPI, engine: EngineAPI) -> None:
    tokenizer, name = engine.tokenizer, engine.name

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """Text (or chat messages) to the model's token ids; llama-server's or vLLM's fields."""
        body = await read_json(request)
        return _json(core.tokenize(body, tokenizer, model_name=name, max_model_len=engine.max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """Token ids to text (`content`, and `prompt` as vLLM names it)."""
        return _json(core.detokenize(await read_json(request), tokenizer, model_name=name))

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """Chat messages rendered with the model's chat template, as text."""
        return _json(core.apply_template(await read_json(request), tokenizer, model_name=name))
