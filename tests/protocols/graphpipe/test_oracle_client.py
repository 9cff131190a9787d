"""Oracle's Python client (graphpipe 1.0.4, unchanged) against a live tokenwire GraphPipe server."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import requests

from tests.protocols.graphpipe.conftest import TYPE_NAMES, ServerThread
from tests.protocols.graphpipe.onnx_models import NUMERIC
from tokenwire.protocols.graphpipe.errors import ErrorCode

remote = pytest.importorskip("graphpipe.remote")
convert = pytest.importorskip("graphpipe.convert")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _sample(type_name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if type_name == "string":
        return np.array([f"s{i}-{'x' * (i % 4)}" for i in range(int(np.prod(shape)))], dtype=object).reshape(
            shape
        )
    dt = np.dtype(type_name)
    if dt.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)


@pytest.mark.parametrize("type_name", list(NUMERIC))
def test_execute_every_numeric_type(onnx_server: ServerThread, type_name: str) -> None:
    x = _sample(type_name, (3, 5))
    got = remote.execute(onnx_server.url(f"echo_{type_name}"), x)  # default input/output names
    assert got.dtype == x.dtype and np.array_equal(got, x)
    named = remote.execute(onnx_server.url(f"echo_{type_name}"), x[:1], "x", "y")
    assert np.array_equal(named, x[:1])


def test_execute_string_tensor(onnx_server: ServerThread) -> None:
    x = _sample("string", (2, 3))
    got = remote.execute(onnx_server.url("echo_string"), x)
    assert got.shape == (2, 3) and [s.decode() for s in got.reshape(-1)] == list(x.reshape(-1))


def test_execute_multi_every_type_at_once(onnx_server: ServerThread) -> None:
    inputs = [_sample(t, (2, 4), seed=i) for i, t in enumerate(TYPE_NAMES)]
    names = [f"x_{t}" for t in TYPE_NAMES]
    outputs = [f"y_{t}" for t in reversed(TYPE_NAMES)]  # any order the client asks for
    got = remote.execute_multi(onnx_server.url("echo"), inputs, names, outputs)
    assert len(got) == len(TYPE_NAMES)
    for sent, back in zip(reversed(inputs), got, strict=True):
        if sent.dtype == object:
            assert [s.decode() for s in back.reshape(-1)] == list(sent.reshape(-1))
        else:
            assert back.dtype == sent.dtype and np.array_equal(back, sent)


def test_multiple_inputs_and_outputs_match_onnxruntime(onnx_server: ServerThread, onnx_dir) -> None:
    a = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    b = np.arange(12, dtype=np.int64).reshape(4, 3)
    session = ort.InferenceSession(str(onnx_dir / "two.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(["rowsum", "total"], {"a": a, "b": b})
    got = remote.execute_multi(onnx_server.url("two"), [a, b], ["a", "b"], ["rowsum", "total"])
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    # inputs named in the other order are matched by name
    got = remote.execute_multi(onnx_server.url("two"), [b, a], ["b", "a"], ["total"])
    np.testing.assert_array_equal(got[0], want[1])
    # no names at all: the model's default inputs (graph order) and all its outputs
    got = remote.execute_multi(onnx_server.url("two"), [a, b], None, None)
    assert len(got) == 3 and np.array_equal(got[0], want[1]) and np.array_equal(got[2], want[0])


def test_metadata(onnx_server: ServerThread) -> None:
    url = onnx_server.url("two")
    meta = remote.metadata(url)
    assert meta.Name() == b"two" and meta.Server() == b"tokenwire"
    assert remote.get_input_names(url) == ["a", "b"]
    assert remote.get_output_names(url) == ["total", "doubled", "rowsum"]
    assert remote.get_input_shapes(url) == [[None, 3], [None, 3]]  # -1 on the wire for "batch"
    assert remote.get_output_shapes(url) == [[None, 3], [None, 3], [None]]
    assert remote.get_input_types(url) == [np.dtype("float32"), np.dtype("int64")]
    assert remote.get_output_names(onnx_server.url("fixed")) == ["y"]
    assert remote.get_input_shapes(onnx_server.url("fixed")) == [[2, 3]]


def _raises(call, match: str) -> Exception:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match=match) as info:
        call()
    return info.value


def test_error_raising_per_kind(onnx_server: ServerThread) -> None:
    mlp = onnx_server.url("mlp")
    x = np.zeros((2, 8), np.float32)
    _raises(lambda: remote.execute(mlp, x, "nope"), "unknown input 'nope'")
    _raises(lambda: remote.execute(mlp, x, None, "zz"), "unknown output 'zz'")
    _raises(lambda: remote.execute(mlp, x.astype(np.float64)), "input 'x' must be Float32, got Float64")
    _raises(lambda: remote.execute(mlp, np.zeros((2, 7), np.float32)), r"input 'x' must have shape \[-1, 8\]")
    _raises(lambda: remote.execute(onnx_server.url("fixed"), np.zeros((3, 3), np.float32)), r"shape \[2, 3\]")
    _raises(lambda: remote.execute_multi(mlp, [x, x], ["x"], None), "2 input tensors but 1 names")
    _raises(
        lambda: remote.execute_multi(onnx_server.url("two"), [x[:, :3]], ["a"], None),
        r"missing inputs \['b'\]",
    )
    # inputs of one stackable call must agree on their batch (row) dimension
    _raises(
        lambda: remote.execute_multi(
            onnx_server.url("two"), [x[:, :3], np.zeros((3, 3), np.int64)], ["a", "b"], None
        ),
        "inputs disagree on the batch dimension",
    )
    too_big = np.zeros((2, 300_000), np.float32)  # 2.4 MB > the fixture's 1 MiB limit
    err = _raises(lambda: remote.execute(mlp, too_big), "413")
    assert isinstance(err, requests.HTTPError)
    err = _raises(lambda: remote.execute(onnx_server.url("no_such_model"), x), "404")
    assert isinstance(err, requests.HTTPError)
    # the server keeps serving
    assert remote.execute(mlp, x).shape == (2, 4)


def test_model_failure_and_undecodable_body(onnx_server: ServerThread) -> None:
    # Identity on a string model fed a float tensor is caught as a type error; a true runtime
    # failure: the reshape model cannot reshape 3 values into rows of 4
    err = _raises(lambda: remote.execute(onnx_server.url("reshape4"), np.zeros((1, 3), np.float32)), "failed")
    assert "reshape4" in str(err)
    assert remote.execute(onnx_server.url("reshape4"), np.zeros((1, 8), np.float32)).shape == (2, 4)
    # an undecodable body: Oracle's decoder reads our error response
    answer = requests.post(onnx_server.url("mlp"), data=b"not a flatbuffer at all")
    assert answer.status_code == 200 and answer.headers["X-GraphPipe-Error-Code"] == str(
        int(ErrorCode.UNDECODABLE)
    )
    outputs, errors = convert.deserialize_infer_response(answer.content)
    assert outputs == [] and errors[0]["code"] == ErrorCode.UNDECODABLE
    assert b"malformed flatbuffer" in errors[0]["message"]
