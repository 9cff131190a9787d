"""Dynamic batching: concurrent stackable requests share model calls; each gets its own rows."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest

from tests.protocols.graphpipe.conftest import ServerThread
from tokenwire.protocols.graphpipe.client import AsyncClient, Client, GraphPipeClientError
from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel

remote = pytest.importorskip("graphpipe.remote")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def batching_server(onnx_dir) -> Iterator[ServerThread]:
    names = ("mlp", "reshape4", "fixed")
    server = ServerThread(
        lambda ex: [OnnxModel(n, onnx_dir / f"{n}.onnx", ex) for n in names],
        batch_window_ms=150.0,
        max_batch=64,
    )
    yield server
    server.stop()


def _rows(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((1 + i % 3, 8)).astype(np.float32)


def test_threads_with_oracle_client_are_merged(batching_server: ServerThread, onnx_dir) -> None:
    batcher = batching_server.server.endpoints["mlp"].batcher
    calls, requests = batcher.model_calls, batcher.requests
    n = 8
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(n)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = remote.execute(batching_server.url("mlp"), _rows(i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert batcher.requests - requests == n
    assert batcher.model_calls - calls < n  # merged
    assert batcher.largest_batch > 3
    session = ort.InferenceSession(str(onnx_dir / "mlp.onnx"), providers=["CPUExecutionProvider"])
    for i in range(n):
        np.testing.assert_allclose(results[i], session.run(["y"], {"x": _rows(i)})[0], rtol=1e-5, atol=1e-6)


def test_async_burst_is_one_call_and_a_bad_request_fails_alone(
    batching_server: ServerThread, onnx_dir
) -> None:
    session = ort.InferenceSession(str(onnx_dir / "mlp.onnx"), providers=["CPUExecutionProvider"])

    async def burst() -> list[object]:
        async with AsyncClient(batching_server.url("mlp")) as client:
            return await asyncio.gather(*(client.execute(_rows(i)) for i in range(16)))

    batcher = batching_server.server.endpoints["mlp"].batcher
    calls = batcher.model_calls
    results = asyncio.run(burst())
    assert batcher.model_calls - calls == 1  # 16 requests, 32 rows <= max_batch, one window
    for i, got in enumerate(results):
        np.testing.assert_allclose(got, session.run(["y"], {"x": _rows(i)})[0], rtol=1e-5, atol=1e-6)

    # reshape4 stacks [n, 2] inputs; merged, [4, 2] reshapes to [2, 4] rows that cannot be
    # split back per request, so the batcher reruns each alone; one request (3 values) fails
    async def mixed() -> list[object]:
        async with AsyncClient(batching_server.url("reshape4")) as client:
            good = [client.execute(np.full((2, 2), i, np.float32)) for i in range(3)]
            return await asyncio.gather(
                *good, client.execute(np.zeros((1, 3), np.float32)), return_exceptions=True
            )

    *good, bad = asyncio.run(mixed())
    for i, got in enumerate(good):
        assert isinstance(got, np.ndarray) and got.tolist() == [[float(i)] * 4]
    assert isinstance(bad, GraphPipeClientError) and "reshape4" in str(bad)


def test_fixed_shape_model_is_never_merged(batching_server: ServerThread) -> None:
    batcher = batching_server.server.endpoints["fixed"].batcher
    calls = batcher.model_calls

    async def burst() -> list[object]:
        async with AsyncClient(batching_server.url("fixed")) as client:
            return await asyncio.gather(*(client.execute(np.full((2, 3), i, np.float32)) for i in range(4)))

    results = asyncio.run(burst())
    assert batcher.model_calls - calls == 4
    assert [r.tolist() for r in results] == [[[3.0 * i] * 2] * 2 for i in range(4)]


def test_max_batch_caps_rows(onnx_dir) -> None:
    server = ServerThread(
        lambda ex: [OnnxModel("mlp", onnx_dir / "mlp.onnx", ex)], batch_window_ms=150.0, max_batch=4
    )
    try:

        async def burst() -> None:
            async with AsyncClient(server.url("mlp")) as client:
                await asyncio.gather(*(client.execute(np.ones((2, 8), np.float32)) for _ in range(6)))

        asyncio.run(burst())
        batcher = server.server.endpoints["mlp"].batcher
        assert batcher.largest_batch <= 4 and batcher.model_calls >= 3
        with Client(server.url("mlp")) as client:  # a single request larger than max_batch still runs
            assert client.execute(np.ones((9, 8), np.float32)).shape == (9, 4)
    finally:
        server.stop()
