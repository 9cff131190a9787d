"""The official `openai` client's embeddings against a live `tokenwire serve` on SmolLM2 (its
GGUF declares no pooling: mean), and the tokenizer endpoints on the same port."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.protocols.openai.conftest import API_KEY, MODEL, http, openai_only_serve

TEXTS = ["The capital of France is Paris.", "A llama is a domesticated South American camelid.", "hi"]


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    with openai_only_serve("--api-key", API_KEY) as (port, _):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(root: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{root}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_the_openai_client_gets_unit_vectors(client: Any, smollm2_source: Any) -> None:
    base64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 576) and floats.model == MODEL
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(np.array([d.embedding for d in base64.data]), vectors)
    tokens = sum(len(smollm2_source.tokenizer.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # one text alone is the same vector as in the batch (other rows, other padding)
    alone = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(alone.data[0].embedding, vectors[1], atol=1e-4)
    short = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=64, encoding_format="float")
    cut = vectors[:, :64] / np.linalg.norm(vectors[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in short.data], cut, atol=1e-4)


def test_token_input_and_errors(client: Any, smollm2_source: Any) -> None:
    import openai

    ids = smollm2_source.tokenizer.encode(TEXTS[0])
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[[1, 2], [49152]])
    assert caught.value.body["param"] == "input[1]"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def test_tokenizer_endpoints(root: str, smollm2_source: Any) -> None:
    tok = smollm2_source.tokenizer
    status, _, got = http("POST", f"{root}/tokenize", {"prompt": TEXTS[0]})
    assert status == 200 and got["tokens"] == tok.encode(TEXTS[0]) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 8192
    status, _, back = http("POST", f"{root}/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["prompt"] == tok.decode(got["tokens"])
    assert http("POST", f"{root}/tokenize", {"content": "x"}, key=None)[0] == 401
    status, _, card = http("GET", f"{root}/v1/models")
    assert card["data"][0]["pooling"] == "mean"
