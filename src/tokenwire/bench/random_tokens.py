"""A model that skips the forward pass and returns random logits.

It stands in for a real model where only the cost around the model matters: the LMTP
benchmark uses it to measure transport overhead (like LMQL's `random` backend), with the
real engine (scheduler, KV blocks, sampler, sessions) still doing all of its work. Logits
are rows of a fixed random table picked by a hash of the token and its position, so they
are reproducible and cost a lookup rather than a fresh draw of vocab_size numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch
from torch import nn

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.model.config import ModelConfig
from tokenwire.model.layers.attention import AttentionBackend

T = TypeVar("T")

TABLE_ROWS = 257  # prime: consecutive (token, position) pairs spread over the table


class RandomTokenModel(nn.Module):
    """DecoderModel's interface (forward, logits, config, dtype, device, max_positions) without
    its computation: logits ~ N(0, 1). It is handed the step's paged-attention metadata like
    the real model and ignores it.

    The config keeps the vocabulary and context length of the model it imitates but one
    layer, so the (unused) KV cache costs 1/num_layers of the real one."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = dataclasses.replace(config, num_layers=1)
        self.max_positions = max_positions or config.max_position_embeddings
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(TABLE_ROWS, config.vocab_size, generator=generator))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.table.device

    # DecoderModel's interface. True: a decode-only step hands it the fused kernel's metadata (two
    # small tensors) rather than the unfused one's masks, which cost ~170 us a step to build
    can_fuse_decode = True

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        capture_layers: tuple[int, ...] = (),
        capture_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # The "hidden state" of a row is the table row its logits come from.
        hidden = (ids * 31 + positions) % TABLE_ROWS
        rows = len(hidden) if capture_index is None else len(capture_index)
        captured = {layer: torch.zeros(rows, self.config.hidden_size) for layer in capture_layers}
        return hidden, captured

    def logits(self, hidden: torch.Tensor, fused_decode: bool = False) -> torch.Tensor:
        """`fused_decode`: DecoderModel's lm_head option on fused decode steps; nothing to fuse here."""
        if len(hidden) == 1:  # a single stream's decode step: a view, no copy of the row
            row = int(hidden[0])
            return self.table[row : row + 1]
        return self.table[hidden]


def random_twin(engine: Engine, name: str | None = None, kv_cache_mb: float = 64) -> Engine:
    """An engine around RandomTokenModel with `engine`'s config and tokenizer: the no-model
    baseline the protocol benchmarks run beside the real engine."""
    config, tokenizer = engine.config, engine.tokenizer
    return Engine(
        lambda: RandomTokenModel(config), tokenizer, name=name or engine.name, kv_cache_mb=kv_cache_mb
    )


def run_with_random_twin(settings: EngineSettings, run: Callable[[Engine, Engine], Awaitable[T]]) -> T:
    """Build the real engine from `settings` and its random twin, run `run(engine, twin)` in a
    fresh event loop, and shut both down whatever happens."""
    engine = build_engine(settings)
    twin = random_twin(engine)
    try:
        return asyncio.run(run(engine, twin))
    finally:
        twin.shutdown()
        engine.shutdown()
