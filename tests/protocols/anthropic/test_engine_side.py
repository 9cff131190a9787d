"""The engine side the Anthropic routes share with the OpenAI API, on the no-model backend
(real scheduling, random logits): --max-queued's 429, and a server stopping mid-stream ending
the stream with Anthropic's `error` event."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.protocols.openai.conftest import MODEL, InProcess

ASK = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
# a grammar the answer cannot end early under: only the server's stop ends it
ENDLESS = {
    "format": {
        "type": "json_schema",
        "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 2000},
    }
}


@pytest.fixture
def random_engine(smollm2_source: Any) -> Iterator[Any]:
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    engine = Engine(
        lambda: RandomTokenModel(smollm2_source.config),
        smollm2_source.tokenizer,
        name=MODEL,
        kv_cache_mb=64,
        max_running=1,
    )
    yield engine
    engine.shutdown()


def test_a_full_queue_is_a_429_rate_limit_error_with_retry_after(random_engine: Any) -> None:
    server = InProcess(random_engine, max_queued=0)  # every request finds the queue full
    try:
        response = httpx.post(f"{server.url.removesuffix('/v1')}/v1/messages", json=ASK, timeout=30)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and "--max-queued" in error["message"]
    finally:
        server.close()


def test_a_server_stopping_mid_stream_sends_an_overloaded_error_event(random_engine: Any) -> None:
    server = InProcess(random_engine)
    try:
        client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="none", max_retries=0)
        with client.messages.stream(**{**ASK, "max_tokens": 8000}, output_config=ENDLESS) as stream:
            events = iter(stream)
            for _ in range(4):
                next(events)
            stopping = threading.Thread(target=server.close)
            stopping.start()
            with pytest.raises(anthropic.APIStatusError) as info:
                for _ in events:
                    pass
        stopping.join(10)
        assert not stopping.is_alive()
        assert info.value.body["error"] == {"type": "overloaded_error", "message": "server shutting down"}
        assert random_engine.stats()["running"] == 0
    finally:
        server.close()
