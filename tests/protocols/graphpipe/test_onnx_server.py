"""ONNX models built with onnx.helper, served, and compared with onnxruntime in-process."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import requests

from tests.protocols.graphpipe import onnx_models
from tests.protocols.graphpipe.conftest import ServerThread
from tokenwire.protocols.graphpipe.client import AsyncClient, Client, GraphPipeClientError
from tokenwire.protocols.graphpipe.errors import ErrorCode
from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel
from tokenwire.protocols.graphpipe.types import Type


def test_mlp_with_dynamic_batch_matches_onnxruntime(onnx_server: ServerThread, onnx_dir) -> None:
    session = ort.InferenceSession(str(onnx_dir / "mlp.onnx"), providers=["CPUExecutionProvider"])
    with Client(onnx_server.url("mlp")) as client:
        for rows in (1, 3, 17):
            x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
            want = session.run(["y"], {"x": x})[0]
            got = client.execute(x)
            assert isinstance(got, np.ndarray) and got.shape == (rows, 4)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_metadata_from_the_graph(onnx_server: ServerThread) -> None:
    with Client(onnx_server.url("mlp")) as client:
        meta = client.metadata()
    assert [(io.name, io.type, io.shape) for io in meta.inputs] == [("x", Type.Float32, [-1, 8])]
    assert [(io.name, io.type, io.shape) for io in meta.outputs] == [("y", Type.Float32, [-1, 4])]
    with Client(onnx_server.url("echo")) as client:
        types = {io.name: io.type for io in client.metadata().inputs}
    assert types["x_float16"] == Type.Float16 and types["x_uint64"] == Type.Uint64
    assert types["x_string"] == Type.String


def test_get_json_html_and_lifecycle_routes(onnx_server: ServerThread) -> None:
    meta = requests.get(onnx_server.url("mlp")).json()
    assert meta["name"] == "mlp" and meta["inputs"][0] == {
        "name": "x", "description": "tensor(float)", "shape": [-1, 8], "type": "Float32"
    }  # fmt: skip
    assert meta["models"]["two"] == "/two"
    page = requests.get(onnx_server.url("mlp"), headers={"Accept": "text/html"})
    assert page.headers["Content-Type"].startswith("text/html") and "<h1>mlp</h1>" in page.text
    assert requests.get(onnx_server.url()).json()["name"] == "mlp"  # first model is the default at /
    assert requests.get(onnx_server.url("missing")).status_code == 404
    for route in ("control/is_ready", "control/is_alive"):
        answer = requests.get(onnx_server.url(route))
        assert answer.status_code == 200 and answer.text == "ok\n"
    stats = requests.get(onnx_server.url("control/stats")).json()
    assert stats["mlp"]["requests"] >= 0


def test_async_client_and_errors(onnx_server: ServerThread) -> None:
    async def go() -> None:
        async with AsyncClient(onnx_server.url("two")) as client:
            a = np.ones((2, 3), np.float32)
            b = np.full((2, 3), 2, np.int64)
            total, rowsum = await client.execute_multi([a, b], ["a", "b"], ["total", "rowsum"])
            assert total.tolist() == [[3.0] * 3] * 2 and rowsum.tolist() == [9.0, 9.0]
            meta = await client.metadata()
            assert meta.name == "two"
            with pytest.raises(GraphPipeClientError, match="unknown output 'nope'") as info:
                await client.execute_multi([a, b], ["a", "b"], ["nope"])
            assert info.value.code == ErrorCode.UNKNOWN_OUTPUT

    asyncio.run(go())


def test_response_cache(onnx_dir) -> None:
    server = ServerThread(
        lambda ex: [OnnxModel("mlp", onnx_dir / "mlp.onnx", ex)], cache_mb=1.0, max_request_mb=1.0
    )
    try:
        x = np.ones((2, 8), np.float32)
        with Client(server.url("mlp")) as client:
            first = client.execute(x)
            second = client.execute(x)
            third = client.execute(x + 1)
        assert np.array_equal(first, second) and not np.array_equal(first, third)
        ep = server.server.endpoints["mlp"]
        assert ep.batcher.model_calls == 2  # the repeat was answered from the cache
        assert server.server.cache is not None and server.server.cache.hits == 1
    finally:
        server.stop()


def test_cache_is_bounded() -> None:
    from tokenwire.protocols.graphpipe.cache import ResponseCache

    cache = ResponseCache(100)
    for i in range(10):
        cache.put(bytes([i]), b"x" * 30)
    assert cache.bytes <= 100 and len(cache) == 3 and cache.get(bytes([9])) == b"x" * 30
    assert cache.get(bytes([0])) is None


def test_onnx_runs_in_pool_with_two_intra_op_threads(onnx_dir) -> None:
    with ThreadPoolExecutor(1) as pool:
        model = OnnxModel("mlp", onnx_dir / "mlp.onnx", pool)
        assert model.session.get_session_options().intra_op_num_threads == 2
        assert model.stackable
        fixed = OnnxModel("fixed", onnx_dir / "fixed.onnx", pool)
        assert not fixed.stackable and fixed.inputs[0].shape == [2, 3]


def test_cli_describes_and_runs(onnx_server: ServerThread, tmp_path, capsys) -> None:
    from tokenwire.cli import main

    server = ["--url", onnx_server.url(""), "--model-name", "mlp"]
    assert main(["graphpipe", *server, "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["inputs"] == [{"name": "x", "type": "Float32", "shape": [-1, 8]}]
    x = np.ones((1, 8), np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["graphpipe", *server, "--input", str(tmp_path / "x.npy"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert printed["shape"] == [1, 4]
    session = ort.InferenceSession(str(onnx_dir_path(onnx_server)), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(printed["value"], session.run(["y"], {"x": x})[0], rtol=1e-5)
    assert main(["graphpipe", *server, "--input", str(tmp_path / "x.npy"), "--input-name", "q"]) == 1
    assert "unknown input 'q'" in capsys.readouterr().err


def onnx_dir_path(server: ServerThread):  # type: ignore[no-untyped-def]
    model = server.server.endpoints["mlp"].model
    assert isinstance(model, OnnxModel)
    return model.path


def test_serve_args_build_the_server(onnx_dir) -> None:
    import argparse

    from tokenwire.protocols.graphpipe.server import add_serve_args, build_server

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        [
            "--graphpipe-model",
            f"mlp={onnx_dir / 'mlp.onnx'}",
            "--graphpipe-cache-mb",
            "2",
            "--graphpipe-max-batch",
            "8",
        ]
    )
    assert args.graphpipe_port == 9000
    server = build_server(None, args, "127.0.0.1", 0)
    assert list(server.endpoints) == ["mlp"] and server.cache is not None
    assert server.endpoints["mlp"].batcher.max_batch == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--graphpipe-model", "no-equals-sign"])
    assert onnx_models.NUMERIC  # the helper module is importable for the other tests


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(onnx_dir, scheme: str) -> None:
    """RFC 9110 (11.1): any case of the scheme, as on every protocol (protocols/security.py)."""
    server = ServerThread(lambda ex: [OnnxModel("mlp", onnx_dir / "mlp.onnx", ex)], auth_token="s3cret")
    try:
        stats = server.url("control/stats")
        assert (
            requests.get(stats, headers={"Authorization": f"{scheme} s3cret"}, timeout=30).status_code == 200
        )
        for header in ("Basic s3cret", f"{scheme} wrong", "s3cret"):
            assert requests.get(stats, headers={"Authorization": header}, timeout=30).status_code == 401
    finally:
        server.stop()
