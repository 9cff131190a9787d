"""The loaded LM as a tensor model: its tensors equal transformers' and the engine's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.protocols.graphpipe.conftest import ServerThread
from tests.tiny_models import hf_model, ours_from_hf
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError
from tokenwire.protocols.graphpipe.errors import ErrorCode
from tokenwire.protocols.graphpipe.models.lm_model import LanguageModel

remote = pytest.importorskip("graphpipe.remote")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tiny(smollm2_source) -> Iterator[tuple[Engine, torch.nn.Module, ServerThread]]:
    hf = hf_model("smollm2")
    engine = Engine(ours_from_hf(hf), smollm2_source.tokenizer, name="tiny", kv_cache_mb=8)
    server = ServerThread(lambda ex: [LanguageModel(engine)], batch_window_ms=100.0)
    yield engine, hf, server
    server.stop()
    engine.shutdown()


def _ids(b: int, t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 49152, size=(b, t), dtype=np.int64)


def test_tensors_equal_transformers(tiny) -> None:
    engine, hf, server = tiny
    ids = _ids(2, 9, 0)
    with torch.inference_mode():
        ref = hf(torch.from_numpy(ids), output_hidden_states=True)
    outputs = ["logits", "hidden_states", "embedding", "next_token_logprobs"]
    logits, hidden, emb, nxt = remote.execute_multi(
        server.url("tiny"), [ids], ["input_ids"], outputs, config='{"layer": 1}'
    )
    assert logits.shape == (2, 9, engine.logits_size) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref.logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(hidden, ref.hidden_states[1].numpy(), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(emb, ref.hidden_states[-1].mean(1).numpy(), atol=1e-5, rtol=1e-4)
    want = torch.log_softmax(ref.logits[:, -1].float(), -1).numpy()
    np.testing.assert_allclose(nxt, want, atol=1e-4)
    # layer 0 is the embeddings, -1 the final normed states; default output: next_token_logprobs
    with Client(server.url()) as client:  # the LM is the default model at /
        (h0,) = client.execute_multi([ids], None, ["hidden_states"], {"layer": 0})
        (h_last,) = client.execute_multi([ids], None, ["hidden_states"], {"layer": -1})
        default = client.execute(ids)
    np.testing.assert_allclose(h0, ref.hidden_states[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(h_last, ref.hidden_states[-1].numpy(), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(default, nxt, atol=1e-6)


def test_logprobs_equal_the_engine(tiny) -> None:
    engine, _, server = tiny
    ids = _ids(1, 12, 1)
    tokens = ids[0].tolist()
    # the engine's own prompt logprobs (paged-KV path) for positions 1..T-1, and its greedy
    # first token's top alternatives at position T
    opts = GenerateOptions(
        max_tokens=1, logprob_ranges=[(1, len(tokens) + 1)], logprobs=True, top_logprobs=5,
        sampling=SamplingParams(temperature=0.0),
    )  # fmt: skip
    events, _ = engine.generate(None, tokens, opts).result()
    prompt_events = [e for e in events if e.is_prefill and e.position < len(tokens)]
    generated = next(e for e in events if not e.is_prefill)
    (logits,) = remote.execute_multi(server.url("tiny"), [ids], None, ["logits"])
    logp = torch.log_softmax(torch.tensor(logits[0]), -1)
    ours = [float(logp[e.position - 1, tokens[e.position]]) for e in prompt_events]
    assert len(ours) == len(tokens) - 1
    np.testing.assert_allclose(ours, [e.logprob for e in prompt_events], atol=1e-4)
    (nxt,) = remote.execute_multi(server.url("tiny"), [ids], None, ["next_token_logprobs"])
    assert int(nxt[0].argmax()) == generated.token_id
    for token, lp in generated.top_logprobs:
        assert abs(float(nxt[0, token]) - lp) < 1e-4


def test_lm_errors(tiny) -> None:
    _, _, server = tiny
    url = server.url("tiny")
    ids = _ids(1, 4, 2)
    with Client(url) as client:
        cases = [
            (
                lambda: client.execute(ids.astype(np.int32)),
                ErrorCode.WRONG_TYPE,
                "input 'input_ids' must be Int64",
            ),
            (lambda: client.execute(ids[0]), ErrorCode.WRONG_SHAPE, r"must have shape \[-1, -1\]"),
            (lambda: client.execute(ids + 10**6), ErrorCode.BAD_REQUEST, "token id 10"),
            (
                lambda: client.execute_multi([ids], None, ["hidden_states"], "{bad"),
                ErrorCode.BAD_REQUEST,
                "not JSON",
            ),
            (
                lambda: client.execute_multi([ids], None, ["hidden_states"], {"layer": 9}),
                ErrorCode.BAD_REQUEST,
                "layer",
            ),
            (lambda: client.execute(ids, None, "attn"), ErrorCode.UNKNOWN_OUTPUT, "unknown output 'attn'"),
        ]
        for call, code, match in cases:
            with pytest.raises(GraphPipeClientError, match=match) as info:
                call()
            assert info.value.code == code
        assert client.execute(ids).shape == (1, 49152)  # still serving


def test_concurrent_lm_requests_are_batched(tiny) -> None:
    import threading

    _, hf, server = tiny
    batcher = server.server.endpoints["tiny"].batcher
    calls_before, requests_before = batcher.model_calls, batcher.requests
    rows = [_ids(1 + i % 2, 7, 10 + i) for i in range(6)]  # same T: stackable
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(rows))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = remote.execute_multi(server.url("tiny"), [rows[i]], None, ["embedding"])[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert batcher.requests - requests_before == 6
    assert batcher.model_calls - calls_before < 6
    with torch.inference_mode():
        for i, ids in enumerate(rows):
            want = hf(torch.from_numpy(ids), output_hidden_states=True).hidden_states[-1].mean(1).numpy()
            assert results[i].shape == want.shape
            np.testing.assert_allclose(results[i], want, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_real_smollm2_next_token_logprobs(smollm2_engine) -> None:
    engine = smollm2_engine
    server = ServerThread(lambda ex: [LanguageModel(engine)])
    try:
        tokens = engine.tokenizer.encode("The capital of France is")
        opts = GenerateOptions(
            max_tokens=1, logprobs=True, top_logprobs=5, sampling=SamplingParams(temperature=0)
        )
        events, _ = engine.generate(None, tokens, opts).result()
        first = next(e for e in events if not e.is_prefill)
        ids = np.array([tokens], dtype=np.int64)
        nxt, emb = remote.execute_multi(server.url(), [ids], None, ["next_token_logprobs", "embedding"])
        assert int(nxt[0].argmax()) == first.token_id
        # the dense pass (eager layers) and the engine's fused steps make keys ~1e-6 apart, and
        # both round them to the fp16 cache's values (as_stored), now and then an ulp (1e-3) apart
        for token, lp in first.top_logprobs:
            assert abs(float(nxt[0, token]) - lp) < 5e-3
        assert emb.shape == (1, engine.config.hidden_size)
        meta = remote.metadata(server.url(engine.name))
        assert meta.Outputs(0).ShapeAsNumpy().tolist() == [-1, -1, engine.logits_size]
    finally:
        server.stop()
