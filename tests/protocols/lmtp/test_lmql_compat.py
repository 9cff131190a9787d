"""Our server against LMQL 0.7.3's own LMTP client class and query runtime, unchanged."""

from __future__ import annotations

import aiohttp
import pytest

from tests.protocols.lmtp.conftest import engine_greedy, engine_scores, run

lmtp_client = pytest.importorskip(
    "lmql.models.lmtp.lmtp_client", reason="needs lmql==0.7.3 (test dependency)"
)
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


async def with_lmql_client(server, fn):
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"http://127.0.0.1:{server.port}") as ws,
    ):
        client = lmtp_client.LMTPWebSocketClient(server.engine.name, ws)
        client.connect()
        try:
            return await fn(client)
        finally:
            client.handler.cancel()


def test_lmql_client_generate_greedy_equals_the_engine(lmtp_server, lmtp_engine) -> None:
    ids = lmtp_engine.tokenizer.encode(PROMPT)
    want_tokens, want_lps = engine_greedy(lmtp_engine, ids, 6, top=3)

    async def go(client):
        return [
            t
            async for t in client.generate(
                ids, max_tokens=6, temperature=0.0, logit_bias=None, top_logprobs=3
            )
        ]

    got = run(with_lmql_client(lmtp_server, go))
    assert [t["token"] for t in got] == want_tokens
    assert [t["logprob"] for t in got] == pytest.approx(want_lps, abs=1e-4)
    assert [t["finish_reason"] for t in got] == [None] * 5 + ["length"]
    for t in got:
        assert str(t["token"]) in t["top_logprobs"] and len(t["top_logprobs"]) == 3
        assert max(t["top_logprobs"].values()) == t["logprob"]  # greedy picks the best


def test_lmql_client_logit_bias_masks_are_obeyed(lmtp_server, lmtp_engine) -> None:
    """LMQL turns constraints into +-100 biases; a +100 allow-list must confine generation."""
    ids = lmtp_engine.tokenizer.encode(PROMPT)
    allowed = lmtp_engine.tokenizer.encode(" Berlin Madrid London", add_special_tokens=False)
    greedy, _ = engine_greedy(lmtp_engine, ids, 1)

    async def go(client):
        allow = [
            t
            async for t in client.generate(
                ids,
                max_tokens=4,
                temperature=0.0,
                top_logprobs=len(allowed),
                logit_bias={t: 100 for t in allowed},
            )
        ]
        ban = [
            t async for t in client.generate(ids, max_tokens=1, temperature=0.0, logit_bias={greedy[0]: -100})
        ]
        return allow, ban

    allow, ban = run(with_lmql_client(lmtp_server, go))
    for t in allow:
        assert t["token"] in allowed
        assert {int(k) for k in t["top_logprobs"]} <= set(allowed)  # masked tokens are no alternatives
        assert t["logprob"] > -5  # the log-softmax after the bias: allowed tokens hold the mass
    assert ban[0]["token"] != greedy[0]


def test_lmql_client_score_and_model_info(lmtp_server, lmtp_engine) -> None:
    ids = lmtp_engine.tokenizer.encode(PROMPT)
    scored = lmtp_engine.tokenizer.encode(" Paris, of course.", add_special_tokens=False)

    async def go(client):
        scores = [t async for t in client.score(ids, scored)]
        info = await client.request("MODEL_INFO", {"model": lmtp_engine.name})
        return scores, info

    scores, info = run(with_lmql_client(lmtp_server, go))
    assert [t["token"] for t in scores] == scored
    assert [t["logprob"] for t in scores] == pytest.approx(engine_scores(lmtp_engine, ids, scored), abs=1e-4)
    assert all("top_logprobs" not in t for t in scores) and scores[-1]["finish_reason"] == "stop"
    mi = info["model_info"]
    assert mi["model"] == lmtp_engine.name and mi["vocab_size"] == lmtp_engine.vocab_size
    assert mi["eos_token_id"] in lmtp_engine.eos_ids and mi["context_length"] == lmtp_engine.max_model_len


def test_lmql_client_sees_errors_and_the_connection_survives(lmtp_server, lmtp_engine) -> None:
    from lmql.models.lmtp.errors import LMTPStreamError

    async def go(client):
        with pytest.raises(LMTPStreamError, match="outside the vocabulary"):
            async for _ in client.generate([1, 10**9], max_tokens=2):
                pass
        return [t async for t in client.generate([1, 504], max_tokens=2)]

    assert len(run(with_lmql_client(lmtp_server, go))) == 2


def test_lmql_query_with_constraints_runs_against_our_endpoint(lmtp_server, lmtp_engine) -> None:
    import lmql

    model = lmql.model(
        lmtp_engine.name,
        endpoint=f"127.0.0.1:{lmtp_server.port}",
        tokenizer=lmtp_engine.tokenizer.hf.name_or_path,
    )
    choices = [" Berlin", " London", " Paris"]
    result = lmql.run_sync(
        'argmax "Q: What is the capital of France?\\nA: The capital of France is[CITY]" '
        'where CITY in [" Berlin", " London", " Paris"]',
        model=model,
    )
    assert result.variables["CITY"] in choices
    result = lmql.run_sync(
        'argmax "List three colors:\\n-[COLOR]" where STOPS_AT(COLOR, "\\n") and len(TOKENS(COLOR)) < 6',
        model=model,
    )
    color = result.variables["COLOR"]
    assert color.count("\n") <= 1 and (color.endswith("\n") or len(lmtp_engine.tokenizer.encode(color)) <= 6)
