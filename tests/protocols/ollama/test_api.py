"""Ollama's API against a live `tokenwire serve` on SmolLM2 through the real `ollama` client: on
--http-port beside the OpenAI API and on its own --ollama-port, with an API key."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.protocols.openai.conftest import API_KEY, MODEL, free_port, metric, openai_only_serve

ollama = pytest.importorskip("ollama")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "num_predict": 24}
# asked for a sentence: the bare question is a near tie at the first token for the file's own
# values (tests/e2e/test_smollm2.py says by how much)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def ports() -> Iterator[tuple[int, int]]:
    """(--http-port, --ollama-port) of one server with both and an API key."""
    ollama_port = free_port()
    with openai_only_serve("--api-key", API_KEY, "--ollama-port", str(ollama_port)) as (port, log):
        assert f"Ollama API listening on http://127.0.0.1:{ollama_port}" in log
        yield port, ollama_port


@pytest.fixture(scope="module")
def client(ports: tuple[int, int]) -> Any:
    return ollama.Client(host=f"http://127.0.0.1:{ports[0]}", headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def own_port(ports: tuple[int, int]) -> Any:
    return ollama.Client(host=f"http://127.0.0.1:{ports[1]}", headers=AUTH, timeout=120)


def test_chat_reports_text_reason_counts_and_nanoseconds(client: Any) -> None:
    reply = client.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    assert "Paris" in reply.message.content and reply.message.role == "assistant"
    assert reply.done and reply.done_reason in ("stop", "length") and reply.model == MODEL
    assert reply.prompt_eval_count > 0 and 0 < reply.eval_count <= 24
    durations = (reply.load_duration, reply.prompt_eval_duration, reply.eval_duration)
    assert all(isinstance(d, int) and d >= 0 for d in durations) and reply.total_duration >= sum(durations)


def test_streamed_chat_is_the_whole_reply_in_lines(client: Any) -> None:
    whole = client.chat(model=MODEL, messages=QUESTION, options=GREEDY).message.content
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason in ("stop", "length") and parts[-1].eval_count > 0


def test_greedy_chat_is_the_openai_apis(client: Any, ports: tuple[int, int]) -> None:
    import openai

    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    theirs = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    ours = client.chat(model=f"{MODEL}:latest", messages=messages, options=GREEDY)
    assert ours.message.content == theirs.choices[0].message.content
    assert ours.eval_count == theirs.usage.completion_tokens


def test_generate_returns_a_context_that_continues_the_conversation(client: Any) -> None:
    first = client.generate(model=MODEL, prompt="Name a colour.", options=GREEDY)
    assert first.response and first.context and first.done
    both = client.generate(model=MODEL, prompt="Another one.", context=first.context, options=GREEDY)
    assert both.context[: len(first.context)] == first.context
    assert both.prompt_eval_count > len(first.context)


def test_raw_generate_and_stop(client: Any) -> None:
    reply = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={**GREEDY, "stop": [" 7"]})
    assert reply.response.startswith(" 5, 6,") and " 7" not in reply.response and reply.done_reason == "stop"
    parts = list(client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, stream=True, options=GREEDY))
    assert "".join(p.response for p in parts[:-1]).startswith(" 5")


def test_format_json_and_a_schema(client: Any) -> None:
    options = {"temperature": 0, "num_predict": 60}
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}},
        "required": ["age"],
        "additionalProperties": False,
    }
    reply = client.chat(
        model=MODEL, messages=[{"role": "user", "content": "A person's age?"}], format=schema, options=options
    )
    assert isinstance(json.loads(reply.message.content)["age"], int)
    free = client.generate(model=MODEL, prompt="Describe Paris in JSON.", format="json", options=options)
    assert free.response.startswith("{")


def test_listings_on_both_ports(client: Any, own_port: Any, ports: tuple[int, int]) -> None:
    for each in (client, own_port):
        assert [m.model for m in each.list().models] == [f"{MODEL}:latest"]
        assert each.ps().models[0].context_length > 0
        assert "completion" in each.show(MODEL).capabilities
    for port in ports:
        assert httpx.get(f"http://127.0.0.1:{port}/api/version", headers=AUTH).json()["version"]
    assert httpx.get(f"http://127.0.0.1:{ports[1]}/").text == "Ollama is running"
    reply = own_port.generate(model=MODEL, prompt="Hi", options={"temperature": 0, "num_predict": 4})
    assert reply.done and reply.eval_count <= 4


def test_errors_in_ollamas_shape(client: Any, ports: tuple[int, int]) -> None:
    cases = [
        (lambda: client.generate(model="llama3", prompt="x"), 404, 'model "llama3" not found'),
        (
            lambda: client.generate(model=MODEL, prompt="x", options={"repeat_penalty": 1.3}),
            400,
            "repeat_penalty",
        ),
        (lambda: client.chat(model=MODEL, messages=QUESTION, options={"top_p": 7}), 400, "options.top_p"),
        (lambda: client.embed(model="nope", input="x"), 404, 'model "nope" not found'),
        (lambda: ollama.Client(host=f"http://127.0.0.1:{ports[1]}").list(), 401, "API key"),
    ]
    for call, status, words in cases:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == status and words in caught.value.error, caught.value
    raw = httpx.post(f"http://127.0.0.1:{ports[0]}/api/chat", content=b"{", headers=AUTH)
    assert raw.status_code == 400 and "invalid JSON" in raw.json()["error"]
    ids = httpx.post(
        f"http://127.0.0.1:{ports[0]}/api/embed", json={"model": MODEL, "input": [1]}, headers=AUTH
    )
    assert ids.status_code == 400 and "input must be" in ids.json()["error"]
    big = httpx.post(
        f"http://127.0.0.1:{ports[0]}/api/generate",
        json={"model": MODEL, "prompt": "x", "options": {"seed": 2**64}},
        headers=AUTH,
    )
    assert big.status_code == 400 and "options.seed" in big.json()["error"]


def test_embeddings_through_the_shared_pooling(client: Any) -> None:
    both = client.embed(model=MODEL, input=["Paris is in France.", "A cat sat."])
    assert len(both.embeddings) == 2 and both.prompt_eval_count > 0
    assert all(abs(sum(v * v for v in vector) - 1) < 1e-3 for vector in both.embeddings)
    old = client.embeddings(model=MODEL, prompt="Paris is in France.")
    assert old.embedding == pytest.approx(both.embeddings[0], abs=1e-4)
    assert client.embed(model=MODEL, input=[]).embeddings == []


def test_counted_as_its_own_protocol_and_cancelled_by_a_disconnect(ports: tuple[int, int]) -> None:
    root = f"http://127.0.0.1:{ports[0]}"
    before = metric(root, "tokenwire_requests_total", protocol="ollama", outcome="cancelled")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "options": {"num_predict": 4000}}
    with httpx.stream("POST", f"{root}/api/generate", json=body, headers=AUTH, timeout=120) as stream:
        first = next(stream.iter_lines())
        assert json.loads(first)["done"] is False
    deadline = time.monotonic() + 60
    while metric(root, "tokenwire_requests_total", protocol="ollama", outcome="cancelled") <= before:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.2)
    assert (
        metric(root, "tokenwire_requests_total", protocol="ollama", outcome="stop")
        + metric(root, "tokenwire_requests_total", protocol="ollama", outcome="length")
        > 0
    )
