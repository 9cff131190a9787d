"""The web playground (issue 19): a page at `/` of the API port, and the JSON it polls.

The page is plain ES modules and CSS shipped in this package (web/): no CDN, no build step. It
talks only to this API (sessions, streaming completions with logprobs and readouts); the one
route added for it is `GET /stats`, the engine's state as JSON (what /metrics exposes as
Prometheus text), which the engine panel reads every second. Like /health it needs no API key.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from tokenwire import metrics

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

WEB = Path(__file__).with_name("web")


def stats_of(engine: EngineAPI) -> dict[str, Any]:
    """The engine panel's numbers; tokens/s is the client's difference of `computed_tokens`
    (positions run through the model, prefill and decode) over `time`."""
    s = engine.stats()
    total = s["kv_blocks_total"]
    used = total - s["kv_blocks_available"]
    concepts = engine.concepts
    return {
        "model": engine.name,
        "time": time.time(),
        "running": s["running"],
        "queued": s["waiting"],
        "sessions": s["sessions"],
        "kv_blocks_total": total,
        "kv_blocks_used": used,
        "kv_usage": used / total if total else 0.0,
        "computed_tokens": s["computed_tokens"],
        "steps": s["steps"],
        # prompt-lookup guesses (engine/speculation.py): run, kept, and the steps that ran some
        "spec_proposed": s["spec_proposed"],
        "spec_accepted": s["spec_accepted"],
        "spec_verifications": s["spec_verifications"],
        "max_model_len": engine.max_model_len,
        # finished requests per API / protocol (OpenAI, Anthropic, Ollama, LMTP, ...), as /metrics counts them
        "requests_by_protocol": metrics.requests_by_protocol(),
        # sessions that outlive the process (engine/persistence.py); None with --no-persist
        "persistence": {k: s[k] for k in PERSISTENCE_STATS} if "sessions_persisted" in s else None,
        "concepts": list(concepts.names) if concepts is not None else [],
        "layers": list(concepts.layers) if concepts is not None else [],
    }


PERSISTENCE_STATS = (
    "sessions_persisted",
    "kv_disk_blocks",
    "kv_disk_bytes",
    "kv_disk_reads",
    "kv_disk_writes",
)


def add_playground_routes(app: FastAPI, engine: EngineAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/stats")
    async def stats() -> Response:
        """The engine's state now: running/queued requests, KV blocks, sessions, tokens computed."""
        return Response(orjson.dumps(stats_of(engine)), media_type="application/json")

    app.mount("/playground", StaticFiles(directory=WEB), name="playground")
