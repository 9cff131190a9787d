"""tokenwire's extensions through `extra_body`: regex, grammar, top_k, priority, readouts, penalties;
and a non-streaming request whose client goes away."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

from tests.protocols.openai.conftest import MODEL, InProcess, http, metric

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "When was the Eiffel Tower built?"}]


def test_regex_and_grammar_constrain_the_output(client: Any) -> None:
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.8, seed=1, max_tokens=20, extra_body={"regex": pattern}
    )
    assert re.fullmatch(pattern, reply.choices[0].message.content)
    grammar = 'start: answer "." \nanswer: "yes" | "no" | "maybe"'
    text = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, extra_body={"grammar": grammar}
    )
    assert text.choices[0].text in ("yes.", "no.", "maybe.")


def test_top_k_one_is_greedy_and_priority_is_accepted(client: Any) -> None:
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    top1 = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.5, max_tokens=12, extra_body={"top_k": 1, "priority": 0}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_penalties_reduce_repeated_tokens(client: Any) -> None:
    def repeats(**penalties: float) -> int:
        reply = client.completions.create(
            model=MODEL,
            prompt="Repeat after me: yes yes yes yes",
            temperature=0,
            max_tokens=12,
            logprobs=0,
            extra_body={"ignore_eos": True},  # every variant yields 12 tokens to compare
            **penalties,
        )
        tokens = reply.choices[0].logprobs.tokens
        assert len(tokens) == 12
        return len(tokens) - len(set(tokens))

    plain = repeats()
    # greedy SmolLM2 says " yes" 12 times here, each time ahead of the runner-up by only ~1
    # logit, so a presence penalty (paid once per token) must break the loop as well
    assert plain > 2
    assert repeats(frequency_penalty=2.0) < plain
    assert repeats(presence_penalty=2.0) < plain


def test_a_non_streaming_client_that_leaves_cancels_its_request(openai_server: str, root: str) -> None:
    """The request ends as cancelled, not after its 4000 tokens (counted on /metrics); the
    waits are hang guards."""
    port = int(openai_server.split(":")[2].split("/")[0])
    cancelled = metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="openai")
    generated = metric(root, "tokenwire_generated_tokens_total", protocol="openai")
    body = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], '
        '"max_tokens": 4000, "ignore_eos": true}'
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer test-key-123\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        deadline = time.monotonic() + 30
        while http("GET", f"{root}/health", key=None)[2]["running"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 120
    while http("GET", f"{root}/health", key=None)[2]["running"] != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="openai") == cancelled + 1
    assert metric(root, "tokenwire_generated_tokens_total", protocol="openai") - generated < 4000


@pytest.fixture
def with_concepts(smollm2_source: Any) -> Iterator[str]:
    """An in-process API over the no-model backend with two concepts at layers 0 and 1."""
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.concepts import ConceptSet
    from tokenwire.engine.engine import Engine

    hidden = smollm2_source.config.hidden_size
    concepts = ConceptSet(["honesty", "joy"], [0, 1], torch.randn(2, 2, hidden))
    engine = Engine(
        lambda: RandomTokenModel(smollm2_source.config),
        smollm2_source.tokenizer,
        name=MODEL,
        kv_cache_mb=64,
        concepts=concepts,
    )
    server = InProcess(engine)
    yield server.url
    server.close()
    engine.shutdown()


def test_readouts_per_token(with_concepts: str) -> None:
    client = openai.OpenAI(base_url=with_concepts, api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, extra_body={"readouts": True, "ignore_eos": True}
    )
    readouts = reply.choices[0].model_extra["readouts"]
    assert readouts["concepts"] == ["honesty", "joy"] and readouts["layers"] == [0, 1]
    tokens = readouts["tokens"]
    assert len(tokens) == 5 and all(len(t["values"]) == 2 and len(t["values"][0]) == 2 for t in tokens)
    positions = [t["position"] for t in tokens]
    assert positions == list(range(reply.usage.prompt_tokens, reply.usage.prompt_tokens + 5))
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=5,
        stream=True,
        extra_body={"readouts": True, "ignore_eos": True},
    )
    chunked = [
        t
        for c in streamed
        if c.choices and c.model_extra is not None
        for t in (c.choices[0].model_extra.get("readouts") or {}).get("tokens", [])
    ]
    assert [t["position"] for t in chunked] == positions
    echo = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, echo=True, extra_body={"readouts": True}
    )
    assert len(echo.choices[0].model_extra["readouts"]["tokens"]) == echo.usage.prompt_tokens + 2
