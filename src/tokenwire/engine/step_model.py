"""What a step needs of the model: the typed boundary between engine/step.py and the models.

DecoderModel (model/layers/decoder.py, every family's model) and RandomTokenModel
(bench/random_tokens.py) meet it without naming it: a Protocol, so neither the model package nor
the bench depends on the engine. `check_step_model` holds a model to it once, at load, so a model
that lacks a member fails there with its name rather than as an AttributeError in the first step.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Protocol, cast

import torch

if TYPE_CHECKING:
    from tokenwire.model.config import ModelConfig
    from tokenwire.model.layers.attention import AttentionBackend
    from tokenwire.model.layers.decoder import PagedDecode


class StepModel(Protocol):
    """The model as run_step sees it."""

    @property
    def config(self) -> ModelConfig:
        """Heads and KV heads: the unfused attention folds grouped-query heads by their ratio."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The activations' type: the unfused attention's masks are built in it."""
        ...

    @property
    def can_fuse_decode(self) -> bool:
        """True: every step runs the fused stack (PagedDecode); False: PagedAttention groups."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend | PagedDecode,
        capture_layers: tuple[int, ...],
        capture_index: torch.Tensor | None,
        **vision: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The packed rows' final hidden states [N, hidden] and the captured layers' residual
        streams at `capture_index`. `vision`: a vision model's M-RoPE positions and image
        embeddings (engine/vision.py step_inputs)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the hidden states the step keeps."""
        ...


MEMBERS = ("config", "dtype", "can_fuse_decode", "logits")


def check_step_model(model: object) -> StepModel:
    """`model`, checked against StepModel; a TypeError naming what it lacks otherwise. Looked up
    statically (inspect.getattr_static): no property runs here (can_fuse_decode's first read
    inspects every layer, the model thread's business)."""
    missing = [name for name in MEMBERS if not _has(model, name)]
    if not callable(model):
        missing.append("__call__")
    if missing:
        raise TypeError(f"{type(model).__name__} cannot run engine steps: it has no {', '.join(missing)}")
    return cast(StepModel, model)


def _has(model: object, name: str) -> bool:
    try:
        inspect.getattr_static(model, name)
    except AttributeError:
        return False
    return True
