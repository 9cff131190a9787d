"""embed() and the routes over an engine on a tiny random-weight model: the vectors equal
transformers' final hidden states pooled and normalised here, and the HTTP routes answer as the
functions do (an in-process server over the same engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.protocols.openai.conftest import InProcess, http
from tests.tiny_models import hf_model, ours_from_hf
from tokenwire import metrics
from tokenwire.engine import abandoned_calls
from tokenwire.engine.abandoned_calls import CallAbandoned
from tokenwire.engine.engine import Engine
from tokenwire.protocols.embeddings import core
from tokenwire.protocols.embeddings.core import EmbeddingInputError, embed, embed_counted

KEY = "k-43"
# lengths that make several slices (3, 5 and 17 share one; 260 and 300 are one each)
LENGTHS = (5, 17, 3, 300, 260)


@pytest.fixture(scope="module")
def tiny(smollm2_source: Any) -> Iterator[tuple[Engine, torch.nn.Module]]:
    hf = hf_model("smollm2")
    engine = Engine(ours_from_hf(hf), smollm2_source.tokenizer, name="tiny", kv_cache_mb=8)
    yield engine, hf
    engine.shutdown()


@pytest.fixture(scope="module")
def served(tiny: tuple[Engine, Any]) -> Iterator[str]:
    server = InProcess(tiny[0], api_key=KEY)
    yield server.url.removesuffix("/v1")
    server.close()


def _oracle(hf: Any, rows: list[list[int]], mode: str) -> np.ndarray:
    """transformers' final normed states of each row alone, pooled and normalised here."""
    out = []
    with torch.inference_mode():
        for row in rows:
            states = hf.model(torch.tensor([row])).last_hidden_state[0].double()
            vector = {"mean": states.mean(0), "cls": states[0], "last": states[-1]}[mode]
            out.append((vector / vector.norm()).numpy())
    return np.stack(out)


def _rows(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, size=n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_pooling_equals_transformers(tiny: tuple[Engine, Any], mode: str) -> None:
    engine, hf = tiny
    rows = _rows()
    got = np.array(asyncio.run(embed(engine, rows, pooling=mode)))
    assert got.shape == (len(rows), engine.config.hidden_size)
    np.testing.assert_allclose(got, _oracle(hf, rows, mode), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_texts_dimensions_and_usage(tiny: tuple[Engine, Any]) -> None:
    engine, hf = tiny
    texts = ["The capital of France is Paris.", "llamas"]
    result = asyncio.run(embed_counted(engine, texts, dimensions=10))
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert result.pooling == "mean" and result.prompt_tokens == sum(map(len, ids))
    full = _oracle(hf, ids, "mean")[:, :10]
    np.testing.assert_allclose(result.vectors, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-4)


@pytest.mark.parametrize(
    ("inputs", "param", "code"),
    [
        ([[1, 2], [3, 49152]], "input[1]", "invalid_token"),
        ([[1, True]], "input", "invalid_token"),
        ([[1] * 513], "input", "context_length_exceeded"),
        (["a", ""], "input[1]", "invalid_value"),
        ([], "input", "invalid_value"),
        (["x"] * 2049, "input", "invalid_value"),
    ],
)
def test_embed_refuses_what_it_cannot_embed(
    tiny: tuple[Engine, Any], inputs: Any, param: str, code: str
) -> None:
    assert tiny[0].max_model_len == 512
    with pytest.raises(EmbeddingInputError) as caught:
        asyncio.run(embed(tiny[0], inputs))
    assert (caught.value.param, caught.value.code) == (param, code)


def test_truncate_cuts_to_the_context(tiny: tuple[Engine, Any]) -> None:
    engine, hf = tiny
    row = _rows(1)[3] * 2  # 600 tokens
    got = asyncio.run(embed(engine, [row], truncate=True, pooling="last"))
    np.testing.assert_allclose(got, _oracle(hf, [row[:512]], "last"), atol=1e-4)


def test_a_cancelled_call_stops_at_a_layer(tiny: tuple[Engine, Any]) -> None:
    engine = tiny[0]
    abandoned_calls.cancelled.add(-7)
    try:
        ids, lengths = np.array([[5, 6, 7]]), np.array([3])
        future = engine.model_call(f"{core.__name__}:embed_forward", ids, lengths, "mean", -7)
        with pytest.raises(CallAbandoned):
            future.result(60)
    finally:
        abandoned_calls.cancelled.discard(-7)


def test_cancelling_embed_stops_its_calls(tiny: tuple[Engine, Any]) -> None:
    engine = tiny[0]

    async def cancel_early() -> None:
        task = asyncio.ensure_future(embed(engine, _rows(2)))
        await asyncio.sleep(0)  # it tokenizes and submits its first slice
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_early())
    assert asyncio.run(embed(engine, [[5, 6]]))  # the engine serves on; the cancelled id is gone
    assert not abandoned_calls.cancelled


# ---------------------------------------------------------------------------- over HTTP
def test_the_route_answers_as_embed_does(tiny: tuple[Engine, Any], served: str) -> None:
    engine = tiny[0]
    before = metrics.REQUESTS.labels("openai", "stop")._value.get()
    status, _, body = http("POST", f"{served}/v1/embeddings", {"input": ["a b c", "d"], "model": "tiny"}, KEY)
    assert status == 200, body
    want = asyncio.run(embed(engine, ["a b c", "d"]))
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, atol=1e-6)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in ("a b c", "d"))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert metrics.REQUESTS.labels("openai", "stop")._value.get() == before + 1
    status, _, card = http("GET", f"{served}/v1/models/tiny", key=KEY)
    assert status == 200 and card["pooling"] == "mean"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [[1] * 513]}, 400, "input"),
        ({"input": [[1], [49152]]}, 400, "input[1]"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions"),
        ({"input": "a", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_route_errors_in_openais_shape(served: str, body: Any, status: int, param: str) -> None:
    got, _, answer = http("POST", f"{served}/v1/embeddings", body, KEY)
    assert got == status and answer["error"]["param"] == param and answer["error"]["message"]


def test_tokenizer_routes(tiny: tuple[Engine, Any], served: str) -> None:
    tok = tiny[0].tokenizer
    text = "Hello, tokenizer 🦙!"
    status, _, got = http("POST", f"{served}/tokenize", {"content": text, "add_special": True}, KEY)
    assert status == 200 and got["tokens"] == tok.encode(text)
    status, _, back = http("POST", f"{served}/detokenize", {"tokens": got["tokens"]}, KEY)
    assert status == 200 and back["content"] == back["prompt"] == tok.decode(got["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    status, _, rendered = http("POST", f"{served}/apply-template", {"messages": messages}, KEY)
    assert status == 200 and rendered["prompt"] == tok.chat_prompt(messages)
    status, _, error = http("POST", f"{served}/detokenize", {"tokens": [False]}, KEY)
    assert status == 400 and error["error"]["param"] == "tokens[0]"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/apply-template", "/v1/embeddings"])
def test_the_key_guards_every_route(served: str, path: str) -> None:
    status, _, body = http("POST", f"{served}{path}", {"content": "x"}, key=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
