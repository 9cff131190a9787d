"""Ollama's API in process over the no-model engine (tests/protocols/openai/conftest.py's
random_engine): a stream open when the server stops ends in Ollama's error line; a full queue
is 503 with Retry-After."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.protocols.openai.conftest import MODEL, InProcess

ollama = pytest.importorskip("ollama")
LONG = {"model": MODEL, "prompt": "Hello", "raw": True, "options": {"temperature": 0, "num_predict": 8000}}


def test_a_stream_open_when_the_server_stops_ends_in_an_error(random_engine: Any) -> None:
    server = InProcess(random_engine)
    try:
        client = ollama.Client(host=server.url.removesuffix("/v1"), timeout=60)
        parts = iter(client.generate(**LONG, stream=True))
        assert next(parts).done is False
        stopping = threading.Thread(target=server.close)
        stopping.start()
        with pytest.raises(ollama.ResponseError, match="server shutting down"):
            for _ in parts:
                pass
        stopping.join(10)
        assert not stopping.is_alive() and random_engine.stats()["running"] == 0
    finally:
        server.close()


def test_a_full_queue_is_503_with_retry_after(random_engine: Any) -> None:
    server = InProcess(random_engine, max_queued=0)  # every generation finds the queue full
    try:
        root = server.url.removesuffix("/v1")
        refused = httpx.post(f"{root}/api/generate", json={**LONG, "stream": False}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "--max-queued" in refused.json()["error"]
        assert httpx.get(f"{root}/api/tags", timeout=60).status_code == 200  # listings still answer
    finally:
        server.close()
