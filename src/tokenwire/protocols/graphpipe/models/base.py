"""What the GraphPipe server needs from a model: its metadata, defaults and a batch call."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from tokenwire.protocols.graphpipe.codec import IOMetadata, MetadataResponse


class TensorModel(ABC):
    name: str
    description: str = ""
    inputs: list[IOMetadata]
    outputs: list[IOMetadata]
    # used when a request names no inputs / outputs (the spec lets the server choose)
    default_inputs: list[str]
    default_outputs: list[str]
    # True when dimension 0 of every input and output is a batch dimension, so requests
    # with equal trailing shapes can be stacked into one call and split back afterwards
    stackable: bool = False

    def parse_config(self, config: bytes) -> Hashable:
        """Validate the request's config; the result is part of the batching key and is passed
        to run(). Raise GraphPipeError(BAD_REQUEST) for a config the model does not accept."""
        return None

    def check_values(self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any) -> None:
        """Per-request value checks done before batching (so one bad request fails alone)."""
        return None

    @abstractmethod
    def start(
        self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any
    ) -> asyncio.Future[list[np.ndarray]]:
        """Begin one model call over (possibly stacked) inputs; the future gives the outputs in
        order. Cancelling the future stops what the model can stop (the engine's LM: before its
        next layer); an ONNX call runs to its end."""

    async def run(self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any) -> list[np.ndarray]:
        return await self.start(inputs, outputs, config)

    # Models whose call is cheap CPU work that may run on the event loop thread itself (a
    # lone request then skips two thread hand-offs; see Batcher). None: never inline.
    run_inline: Callable[[dict[str, np.ndarray], list[str], Any], list[np.ndarray]] | None = None

    def metadata(self, version: str) -> MetadataResponse:
        return MetadataResponse(
            name=self.name,
            version=version,
            server="tokenwire",
            description=self.description,
            inputs=self.inputs,
            outputs=self.outputs,
        )

    def close(self) -> None:
        """Release resources (sessions, pools)."""
        return None
