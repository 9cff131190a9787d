"""ONNX models built in the tests with onnx's helper API."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NUMERIC = {
    "uint8": TensorProto.UINT8,
    "int8": TensorProto.INT8,
    "uint16": TensorProto.UINT16,
    "int16": TensorProto.INT16,
    "uint32": TensorProto.UINT32,
    "int32": TensorProto.INT32,
    "uint64": TensorProto.UINT64,
    "int64": TensorProto.INT64,
    "float16": TensorProto.FLOAT16,
    "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE,
}


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def mlp(path: Path, sizes: tuple[int, ...] = (8, 32, 4), seed: int = 0) -> Path:
    """x float32 [batch, in] -> relu MLP -> y float32 [batch, out]; batch is symbolic."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "x"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        w = numpy_helper.from_array((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), f"w{i}")
        bias = numpy_helper.from_array(rng.standard_normal(b).astype(np.float32) * 0.1, f"b{i}")
        inits += [w, bias]
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        last = i == len(sizes) - 2
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], ["y" if last else f"a{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"a{i}"], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
        inits,
    )
    return _save(graph, path)


def echo_all_types(path: Path) -> Path:
    """For every numeric type T: x_T [batch, -1] -> y_T = x_T (Identity); plus String s -> t."""
    nodes, inputs, outputs = [], [], []
    for name, t in (*NUMERIC.items(), ("string", TensorProto.STRING)):
        nodes.append(helper.make_node("Identity", [f"x_{name}"], [f"y_{name}"]))
        inputs.append(helper.make_tensor_value_info(f"x_{name}", t, ["batch", "n"]))
        outputs.append(helper.make_tensor_value_info(f"y_{name}", t, ["batch", "n"]))
    return _save(helper.make_graph(nodes, "echo", inputs, outputs), path)


def echo_one(path: Path, type_name: str) -> Path:
    """x [batch, n] of one type -> y = x (Identity)."""
    t = NUMERIC.get(type_name, TensorProto.STRING)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        f"echo_{type_name}",
        [helper.make_tensor_value_info("x", t, ["batch", "n"])],
        [helper.make_tensor_value_info("y", t, ["batch", "n"])],
    )
    return _save(graph, path)


def two_in_two_out(path: Path) -> Path:
    """a float32 [batch, 3], b int64 [batch, 3] -> total = a + float(b), doubled = 2a, rowsum [batch]."""
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    nodes = [
        helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["a", "bf"], ["total"]),
        helper.make_node("Mul", ["a", "two"], ["doubled"]),
        helper.make_node("ReduceSum", ["total", "axes"], ["rowsum"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "two",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("b", TensorProto.INT64, ["batch", 3]),
        ],
        [
            helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("rowsum", TensorProto.FLOAT, ["batch"]),
        ],
        [two, axes],
    )
    return _save(graph, path)


def fixed_matmul(path: Path) -> Path:
    """x float32 [2, 3] (no dynamic dimension: never batched) -> y = x @ ones [2, 2]."""
    w = numpy_helper.from_array(np.ones((3, 2), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [w],
    )
    return _save(graph, path)


def reshape4(path: Path) -> Path:
    """x float32 [batch, n] -> y = reshape(x, [-1, 4]): fails at run time when 4 does not divide."""
    shape = numpy_helper.from_array(np.array([-1, 4], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "reshape4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 4])],
        [shape],
    )
    return _save(graph, path)
