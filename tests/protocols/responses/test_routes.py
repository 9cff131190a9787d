"""The routes in process over the no-model backend (random tokens, real scheduling and sessions):
ownership between two keys (no --api-key: a client's bearer token is its key) and the store's
bound (half of --max-sessions)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.protocols.openai.conftest import MODEL, InProcess, http


@pytest.fixture(scope="module")
def server(smollm2_source: Any) -> Iterator[InProcess]:
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    engine = Engine(
        lambda: RandomTokenModel(smollm2_source.config),
        smollm2_source.tokenizer,
        name=MODEL,
        kv_cache_mb=64,
        max_running=1,
        max_sessions=6,  # stored responses: at most 3
    )
    served = InProcess(engine)
    yield served
    served.close()
    engine.shutdown()


def create(url: str, key: str, **fields: Any) -> tuple[int, Any]:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    status, _, answer = http("POST", f"{url}/responses", body, key=key)
    return status, answer


def test_a_response_belongs_to_its_key(server: InProcess) -> None:
    url = server.url
    status, mine = create(url, "key-a")
    assert status == 200, mine
    rid = mine["id"]
    assert http("GET", f"{url}/responses/{rid}", key="key-a")[0] == 200
    for method, path in [("GET", rid), ("GET", f"{rid}/input_items"), ("DELETE", rid)]:
        status, _, body = http(method, f"{url}/responses/{path}", key="key-b")
        assert (status, body["error"]["code"]) == (404, "response_not_found")
    status, body = create(url, "key-b", previous_response_id=rid)
    assert (status, body["error"]["param"]) == (404, "previous_response_id")
    assert create(url, "key-a", previous_response_id=rid)[0] == 200  # still there for its owner
    assert http("DELETE", f"{url}/responses/{rid}", key="key-a")[0] == 200


def test_the_store_is_bounded_by_max_sessions(server: InProcess) -> None:
    url = server.url
    ids = [create(url, "key-c")[1]["id"] for _ in range(4)]
    statuses = [http("GET", f"{url}/responses/{rid}", key="key-c")[0] for rid in ids]
    assert statuses == [404, 200, 200, 200]  # the least recently used was forgotten
    assert server.engine.stats()["sessions"] <= 3
