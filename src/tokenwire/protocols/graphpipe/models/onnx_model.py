"""ONNX graphs through onnxruntime, run in a thread pool (onnxruntime releases the GIL)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tokenwire.protocols.graphpipe.codec import IOMetadata
from tokenwire.protocols.graphpipe.models import DEFAULT_SPIN_US
from tokenwire.protocols.graphpipe.models.base import TensorModel
from tokenwire.protocols.graphpipe.types import Type

ORT_TYPES: dict[str, Type] = {
    "tensor(uint8)": Type.Uint8,
    "tensor(int8)": Type.Int8,
    "tensor(uint16)": Type.Uint16,
    "tensor(int16)": Type.Int16,
    "tensor(uint32)": Type.Uint32,
    "tensor(int32)": Type.Int32,
    "tensor(uint64)": Type.Uint64,
    "tensor(int64)": Type.Int64,
    "tensor(float16)": Type.Float16,
    "tensor(float)": Type.Float32,
    "tensor(double)": Type.Float64,
    "tensor(string)": Type.String,
}


def session_options(intra_op_threads: int, spin_us: int | None = DEFAULT_SPIN_US) -> ort.SessionOptions:
    """`spin_us`: 0 = workers never spin, N = spin up to N us, None = onnxruntime's default."""
    opts = ort.SessionOptions()
    # sized for the machine's cores; one call at a time per model keeps them busy without
    # oversubscription, and batching (not parallel calls) gives the throughput
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0" if spin_us == 0 else "1")
    if spin_us:
        opts.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    return opts


def _io(arg: Any) -> IOMetadata:
    # symbolic ("batch") and unknown (None) dimensions are dynamic: -1 in GraphPipe metadata
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or [])]
    return IOMetadata(
        name=arg.name, type=ORT_TYPES.get(arg.type, Type.Null), shape=shape, description=arg.type
    )


class OnnxModel(TensorModel):
    def __init__(
        self,
        name: str,
        path: str | Path,
        executor: Executor,
        *,
        intra_op_threads: int = 2,
        spin_us: int = DEFAULT_SPIN_US,
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.executor = executor
        self.session = ort.InferenceSession(
            str(path),
            sess_options=session_options(intra_op_threads, spin_us),
            providers=["CPUExecutionProvider"],
        )
        self.inputs = [_io(a) for a in self.session.get_inputs()]
        self.outputs = [_io(a) for a in self.session.get_outputs()]
        self.default_inputs = [io.name for io in self.inputs]
        self.default_outputs = [io.name for io in self.outputs]
        self.description = f"ONNX model {self.path.name}"
        self.stackable = all(io.shape and io.shape[0] == -1 for io in (*self.inputs, *self.outputs))
        self._string_inputs = {io.name for io in self.inputs if io.type == Type.String}

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name, arr in inputs.items():
            if name in self._string_inputs:  # onnxruntime wants str elements
                arr = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(arr)
            feed[name] = arr
        return feed

    def _run_sync(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        return [np.asarray(o) for o in self.session.run(outputs, self._feed(inputs))]

    def start(
        self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any
    ) -> asyncio.Future[list[np.ndarray]]:
        return asyncio.get_running_loop().run_in_executor(self.executor, self._run_sync, inputs, outputs)

    def run_inline(self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any) -> list[np.ndarray]:
        return self._run_sync(inputs, outputs)
