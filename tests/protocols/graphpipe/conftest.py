from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.protocols.graphpipe import onnx_models
from tokenwire.protocols.graphpipe.models.base import TensorModel
from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel
from tokenwire.protocols.graphpipe.server import GraphPipeServer

TYPE_NAMES = [*onnx_models.NUMERIC, "string"]


class ServerThread:
    """A GraphPipeServer on its own event loop thread, so blocking clients can call it."""

    def __init__(
        self, make_models: Callable[[ThreadPoolExecutor], list[TensorModel]], **options: object
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.executor = ThreadPoolExecutor(max_workers=2)
        models = make_models(self.executor)

        async def start() -> GraphPipeServer:
            return await GraphPipeServer(models, "127.0.0.1", 0, executor=self.executor, **options).start()

        self.server = self.call(start())

    def call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.server.port}/{name}"

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("onnx")
    onnx_models.mlp(d / "mlp.onnx")
    onnx_models.echo_all_types(d / "echo.onnx")
    onnx_models.two_in_two_out(d / "two.onnx")
    onnx_models.fixed_matmul(d / "fixed.onnx")
    onnx_models.reshape4(d / "reshape4.onnx")
    for name in TYPE_NAMES:
        onnx_models.echo_one(d / f"echo_{name}.onnx", name)
    return d


@pytest.fixture(scope="module")
def onnx_server(onnx_dir: Path) -> Iterator[ServerThread]:
    def models(executor: ThreadPoolExecutor) -> list[TensorModel]:
        names = ["mlp", "echo", "two", "fixed", "reshape4", *(f"echo_{t}" for t in TYPE_NAMES)]
        return [OnnxModel(n, onnx_dir / f"{n}.onnx", executor) for n in names]

    server = ServerThread(models, max_request_mb=1.0)
    yield server
    server.stop()
