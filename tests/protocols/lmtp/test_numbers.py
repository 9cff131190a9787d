"""Numbers are validated as numbers (a hostile-client probe), by the engine's rules
(engine/request.py): seeds are 0 <= seed < 2**64 (not LMTP's own 2**63 - 1), true/false and
1e999 are no numbers in GENERATE or SCORE; each refusal is an error record naming the field,
nothing is created or changed (no session, a buffer as it was), the connection goes on; the
bearer scheme of the handshake is case-insensitive."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.protocols.lmtp.conftest import ServerThread, run
from tests.protocols.lmtp.fakes import Harness, records

M = "fake-model"
GEN = '{"stream_id": 4, "model": "fake-model", "prompt": [5, 6]'
SCORE = '{"stream_id": 4, "model": "fake-model", "prompt": [5], "scored": [6]'


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (f'GENERATE {GEN}, "seed": {2**64}}}', "seed must be in 0..2**64-1"),
        (f'GENERATE {GEN}, "seed": -1}}', "seed must be in 0..2**64-1"),
        (f'GENERATE {GEN}, "seed": true}}', "seed must be an integer"),
        (f'GENERATE {GEN}, "temperature": 1e999}}', "temperature must be a finite number"),
        (f'GENERATE {GEN}, "temperature": true}}', "temperature must be a number"),
        (f'GENERATE {GEN}, "top_p": -1e999}}', "top_p must be a finite number"),
        (f'GENERATE {GEN}, "top_k": false}}', "top_k must be an integer"),
        (f'GENERATE {GEN}, "max_tokens": true}}', "max_tokens must be an integer"),
        (f'GENERATE {GEN}, "logit_bias": {{"5": 1e999}}}}', "logit_bias['5'] must be a finite number"),
        (f'GENERATE {GEN}, "logit_bias": {{"5": true}}}}', "logit_bias['5'] must be a number"),
        (f'GENERATE {GEN}, "stop_token_ids": [true]}}', "stop_token_ids"),
        (f'SCORE {SCORE}, "temperature": true}}', "temperature must be a number"),
        (f'SCORE {SCORE}, "top_p": 1e999}}', "top_p must be a finite number"),
        ('SCORE {"stream_id": 4, "model": "fake-model", "prompt": [5], "scored": [false]}', "scored"),
    ],
)
def test_bad_numbers_are_error_records_naming_the_field(frame: str, needle: str) -> None:
    h = Harness()
    h.conn.feed(frame)
    [(kind, [record])] = h.frames()
    assert kind == "TOKEN" and record["stream_id"] == 4 and needle in record["error"], record
    assert h.engine.handles == [] and h.engine.sessions == {}  # nothing started or created
    h.send("GENERATE", {"stream_id": 5, "model": M, "prompt": [1], "seed": 2**64 - 1})  # goes on
    assert h.watched[-1][1].stream_id == 5 and h.watched[-1][0].options.sampling.seed == 2**64 - 1


def test_a_refused_generate_on_a_buffer_leaves_it_and_creates_nothing() -> None:
    h = Harness()
    h.send("HELLO", {"stream_id": 0, "extensions": ["buffers"]})
    h.frames()
    h.send("BUFFER", {"stream_id": 1, "name": "sys", "prompt": [1, 10, 11]})
    _, st = h.stream()
    h.finish(st, "length", 3)
    h.frames()
    sessions = dict(h.engine.sessions)
    for _ in range(20):
        h.conn.feed(
            f'GENERATE {{"stream_id": 2, "model": "{M}", "buffer": "sys", "prompt": [7], "seed": {2**64}}}'
        )
        [(_, [record])] = h.frames()
        assert "seed" in record["error"], record
    assert h.engine.sessions == sessions  # no fork left behind, the buffer's tokens as they were


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(lmtp_engine, scheme: str) -> None:
    server = ServerThread(lmtp_engine, auth_token="s3cret")

    async def model_info(header: str) -> list[dict]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(server.url, headers={"Authorization": header}) as ws,
        ):
            await ws.send_str(f"MODEL_INFO {json.dumps({'stream_id': 1, 'model': lmtp_engine.name})}")
            kind, _, body = (await ws.receive_str()).partition(" ")
            return records([(kind, json.loads(body))], "MSG")

    try:
        [reply] = run(model_info(f"{scheme} s3cret"))
        assert reply["model_info"]["model"] == lmtp_engine.name
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            run(model_info("Basic s3cret"))
        assert refused.value.status == 401
    finally:
        server.stop()
