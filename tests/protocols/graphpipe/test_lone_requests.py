"""The lone-request fast path: one client alone goes straight to the model (inline on the event
loop for a short call), concurrent clients still queue and merge, answers stay onnxruntime's."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest

from tests.protocols.graphpipe.conftest import ServerThread
from tokenwire.protocols.graphpipe.batcher import Batcher
from tokenwire.protocols.graphpipe.client import AsyncClient, Client
from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel

remote = pytest.importorskip("graphpipe.remote")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(i: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(100 + i).standard_normal((n, 8)).astype(np.float32)


def _want(onnx_dir, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_dir / "mlp.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


@pytest.mark.parametrize(("inline_ms", "inlined"), [(5.0, True), (0.0, False)])
def test_one_client_alone_goes_straight_to_the_model(onnx_dir, inline_ms: float, inlined: bool) -> None:
    server = ServerThread(lambda ex: [OnnxModel("mlp", onnx_dir / "mlp.onnx", ex)], inline_ms=inline_ms)
    try:
        batcher = server.server.endpoints["mlp"].batcher
        with Client(server.url("mlp")) as client:  # one keep-alive connection
            for i in range(6):
                got = client.execute(_rows(i, 2))
                np.testing.assert_allclose(got, _want(onnx_dir, _rows(i, 2)), rtol=1e-5)
        # Oracle's client (a new connection per call, closed after it) is a lone client too
        got = remote.execute(server.url("mlp"), _rows(9))
        np.testing.assert_allclose(got, _want(onnx_dir, _rows(9)), rtol=1e-5)
        assert batcher.requests == batcher.model_calls == 7
        # the first call runs in the pool and times the model; the later short ones inline
        assert batcher.inline_calls == (6 if inlined else 0)
    finally:
        server.stop()


def test_concurrent_clients_are_never_inlined(onnx_dir) -> None:
    server = ServerThread(lambda ex: [OnnxModel("mlp", onnx_dir / "mlp.onnx", ex)], inline_ms=5.0)
    try:
        batcher = server.server.endpoints["mlp"].batcher
        with Client(server.url("mlp")) as client:  # learn the model's call time: it is short
            client.execute(_rows(0))
            client.execute(_rows(0))
        inline_before = batcher.inline_calls
        assert inline_before == 1

        async def burst() -> list[np.ndarray]:
            async with AsyncClient(server.url("mlp")) as client:  # up to 16 connections at once
                return await asyncio.gather(*(client.execute(_rows(i)) for i in range(16)))

        results = asyncio.run(burst())
        for i, got in enumerate(results):
            np.testing.assert_allclose(got, _want(onnx_dir, _rows(i)), rtol=1e-5, atol=1e-6)
        # several connections open: at most the very first request (alone when it came) is
        # inlined; the others queue for the worker
        assert batcher.inline_calls - inline_before <= 1
        assert batcher.model_calls <= batcher.requests
    finally:
        server.stop()


def test_calls_arriving_during_a_direct_call_queue_and_merge(onnx_dir) -> None:
    """A lone call runs directly; three more arrive while it runs: they wait for it, then the
    worker merges them into one call. Deterministic: the pool's one thread is held first."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        model = OnnxModel("mlp", onnx_dir / "mlp.onnx", pool)
        release = threading.Event()

        async def scenario() -> list[list[np.ndarray]]:
            batcher = Batcher(model, inline_max_s=0.0)
            pool.submit(release.wait)  # the direct call's job waits behind this one
            direct = asyncio.ensure_future(batcher.submit({"x": _rows(0)}, ["y"], None, alone=True))
            await asyncio.sleep(0.05)
            queued = [
                asyncio.ensure_future(batcher.submit({"x": _rows(i)}, ["y"], None, alone=False))
                for i in (1, 2, 3)
            ]
            await asyncio.sleep(0.05)
            assert batcher.model_calls == 1 and not direct.done()  # the others wait, not run
            release.set()
            results = await asyncio.gather(direct, *queued)
            assert batcher.requests == 4 and batcher.model_calls == 2 and batcher.largest_batch == 3
            await batcher.close()
            return results

        results = asyncio.run(scenario())
    for i, (got,) in enumerate(results):
        np.testing.assert_allclose(got, _want(onnx_dir, _rows(i)), rtol=1e-5, atol=1e-6)
