"""The Responses API's stored responses outlive the process (issue 44): a `previous_response_id`
chain continues after a restart on the same --state-dir, through the real `openai` package, with
the KV read back from disk, and a response stays its API key's only.

"The same as without the restart": the reference is the same continuation made before the
restart (a stored response stays continuable: branching), greedy, and the engine's arithmetic is
batch-invariant, so the text after the restart must be the very same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.state_server import MODEL, StateServer


def _client(server: StateServer, key: str) -> Any:
    import openai

    base = f"http://127.0.0.1:{server.http}/v1"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def _create(client: Any, **fields: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 12, **fields})


FIRST = "Write one long sentence about the history of the city of Paris, its river and its bridges. " * 3


def test_a_previous_response_id_chain_continues_after_a_restart(tmp_path: Path) -> None:
    import openai

    with StateServer(tmp_path) as server:
        a = _client(server, "key-a")
        first = _create(a, input=FIRST, instructions="Answer briefly.")
        reference = _create(a, input="And its river?", previous_response_id=first.id)
        server.stop()
    with StateServer(tmp_path) as server:
        a, b = _client(server, "key-a"), _client(server, "key-b")
        again = a.responses.retrieve(first.id)  # GET /v1/responses/{id} after the restart
        assert again.id == first.id and again.output_text == first.output_text
        assert [i.content[0].text for i in a.responses.input_items.list(first.id).data] == [FIRST]
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            _create(b, input="And its river?", previous_response_id=first.id)
        second = _create(a, input="And its river?", previous_response_id=first.id)
        assert second.output_text == reference.output_text
        assert second.usage.input_tokens == reference.usage.input_tokens
        cached = second.usage.input_tokens_details.cached_tokens
        assert cached >= 16 * (first.usage.total_tokens // 16) - 16  # the chain's KV, not recomputed
        assert server.metric("tokenwire_kv_disk_reads_total") >= cached // 16
        assert "disk_kv_tokens=" in server.log
        third = _create(a, input="Thanks.", previous_response_id=second.id)  # the chain goes on
        assert third.status in ("completed", "incomplete") and third.output_text
        server.stop()
