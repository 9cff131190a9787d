"""The loaded LM as a tensor model: its tensors equal transformers' and the engine's."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from tests.protocols.graphpipe.conftest import ServerThread
from tests.tiny_models import hf_model, ours_from_hf
from tokenwire.engine import abandoned_calls
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.model.kernels import ops
from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError, build_request
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
        # both round them to the fp16 cache's values (as_stored), now and then an ulp (1e-3)
        # apart. With exact activations: int8 ones turn such last bits into whole rounding steps
        # (0.09 in a logprob here), which is the quantised path's business, not GraphPipe's.
        engine.call_on_model_thread(lambda: ops().set_int16_activations(False)).result()
        try:
            exact = replace(opts, use_prefix_cache=False)  # the cached prompt's KV is int8's
            events, _ = engine.generate(None, tokens, exact).result()
            first = next(e for e in events if not e.is_prefill)
            (nxt,) = remote.execute_multi(server.url(), [ids], None, ["next_token_logprobs"])
        finally:
            engine.call_on_model_thread(lambda: ops().set_int16_activations(True)).result()
        for token, lp in first.top_logprobs:
            assert abs(float(nxt[0, token]) - lp) < 5e-3
        assert emb.shape == (1, engine.config.hidden_size)
        meta = remote.metadata(server.url(engine.name))
        assert meta.Outputs(0).ShapeAsNumpy().tolist() == [-1, -1, engine.logits_size]
    finally:
        server.stop()


# ---- issue 41, finding 10: a call shares the engine, and stops when its client leaves ----------


class HeldSlices:
    """dense_forward (looked up by name at every model call) wrapped: each slice's start and
    end recorded, and the first slice held until the test lets it run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tokenwire.protocols.graphpipe.models import lm_model

        self.lm_model = lm_model
        self.events: list[str] = []
        self.first_started = threading.Event()
        self.release = threading.Event()
        real = lm_model.dense_forward

        def slice_(engine: Engine, ids: np.ndarray, outputs: list[str], layer: int, call_id: int = 0) -> Any:
            self.events.append(f"start {len(ids)}")
            if not self.first_started.is_set():
                self.first_started.set()
                assert self.release.wait(120), "the test never released the first slice"
            try:
                out = real(engine, ids, outputs, layer, call_id)
            except abandoned_calls.CallAbandoned:
                self.events.append("abandoned")
                raise
            self.events.append("done")
            return out

        monkeypatch.setattr(lm_model, "dense_forward", slice_)


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed claim
    while not predicate():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.01)


def test_a_long_call_runs_in_slices_with_engine_steps_between(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """[8, 512] is 8 slices of one row (SLICE_TOKENS = 512): a 4-token request submitted while
    the first slice runs is finished before the call's last slice (it waited 270 s behind one
    whole-batch call before)."""
    engine, _, server = tiny
    held = HeldSlices(monkeypatch)
    ids = _ids(8, 512, 3)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(remote.execute_multi, server.url("tiny"), [ids], ["input_ids"], ["embedding"])
        assert held.first_started.wait(120)
        opts = GenerateOptions(max_tokens=4, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        chat = engine.generate(None, [1, 2, 3, 4], opts)
        held.release.set()
        events, _ = chat.result()
        slices_done_then = held.events.count("done")
        (embedding,) = call.result(timeout=300)
    assert len(events) == 4
    assert slices_done_then < 8, held.events
    assert held.events.count("start 1") == 8 and held.events.count("done") == 8
    monkeypatch.undo()  # the sliced call's rows equal the same rows in a call of their own
    (again,) = remote.execute_multi(server.url("tiny"), [ids[:2]], ["input_ids"], ["embedding"])
    np.testing.assert_allclose(embedding[:2], again, atol=1e-5, rtol=1e-4)


def test_a_call_whose_client_left_stops_before_its_next_layer(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client sends a [8, 512] call and hangs up while the first slice runs: that slice
    stops at its next layer (CallAbandoned), no other slice starts, and the engine serves on."""
    engine, _, server = tiny
    held = HeldSlices(monkeypatch)
    body = bytes(build_request([_ids(8, 512, 4)], ["input_ids"], ["logits"], None))
    head = f"POST /tiny HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.server.port), timeout=60) as sock:
        sock.sendall(head + body)
        assert held.first_started.wait(120)
    _wait_for(lambda: bool(abandoned_calls.cancelled), "the server noticing its client left")
    held.release.set()
    _wait_for(lambda: "abandoned" in held.events, "the running slice stopping")
    opts = GenerateOptions(max_tokens=2, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    events, _ = engine.generate(None, [5, 6, 7], opts).result()
    assert len(events) == 2
    assert held.events == ["start 1", "abandoned"], held.events
    _wait_for(lambda: not abandoned_calls.cancelled, "the cancelled call's id being forgotten")
