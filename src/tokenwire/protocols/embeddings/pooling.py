"""Pooling: which one a model declares, and the math on tensors (sans-IO, plain values in).

A model's embedding of a text is its final normed hidden states [T, H] pooled to one [H]
vector, then L2-normalised to unit length (as OpenAI's embeddings are). The pooling is the one
the model declares, looked for in this order:

1. a GGUF's `<arch>.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank);
2. a sentence-transformers directory's `1_Pooling/config.json` (`pooling_mode_mean_tokens`,
   `pooling_mode_cls_token`, `pooling_mode_lasttoken`);
3. last-token for a decoder embedding model whose files say nothing (Qwen3-Embedding: a Qwen3
   whose config names `Qwen3Model`, or whose name says "Embedding");
4. mean otherwise.

One vector per input is OpenAI's shape, so llama.cpp's "none" (a vector per token) and "rank"
(a reranker's score head, which tokenwire does not run) pool by mean; the card says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last")
# llama.cpp's LLAMA_POOLING_TYPE_*: the value of a GGUF's `<arch>.pooling_type`
GGUF_POOLING: dict[int, str] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
_ST_KEYS: tuple[tuple[str, Pooling], ...] = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
)


@dataclass(frozen=True)
class DeclaredPooling:
    """The pooling used and where it came from (for the model card and the docs)."""

    mode: Pooling
    source: str  # "gguf", "sentence-transformers", "architecture", "default"
    declared: str | None = None  # what the file said, where it said something we map (none, rank)


def from_gguf_fields(fields: dict[str, Any]) -> DeclaredPooling | None:
    """A GGUF's `<arch>.pooling_type`, None where the file has none."""
    arch = fields.get("general.architecture")
    value = fields.get(f"{arch}.pooling_type")
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return None
    name = GGUF_POOLING.get(value, "none")
    if name in POOLINGS:
        return DeclaredPooling(name, "gguf")  # type: ignore[arg-type]
    return DeclaredPooling("mean", "gguf", declared=name)


def from_sentence_transformers(config: dict[str, Any]) -> DeclaredPooling | None:
    """`1_Pooling/config.json`'s mode; None where it names none we run (max, weighted mean)."""
    for key, mode in _ST_KEYS:
        if config.get(key) is True:
            return DeclaredPooling(mode, "sentence-transformers")
    return None


def from_architecture(hf_config: dict[str, Any], name: str) -> DeclaredPooling | None:
    """Last-token for Qwen3's embedding models (trained with it) when their files say nothing."""
    architectures = [str(a) for a in hf_config.get("architectures") or []]
    qwen3 = hf_config.get("model_type") == "qwen3" or any(a.startswith("Qwen3") for a in architectures)
    if qwen3 and ("Qwen3Model" in architectures or "embedding" in name.lower()):
        return DeclaredPooling("last", "architecture")
    return None


def declared_pooling(
    *,
    gguf_fields: dict[str, Any] | None = None,
    model_dirs: tuple[Path, ...] = (),
    hf_config: dict[str, Any] | None = None,
    name: str = "",
) -> DeclaredPooling:
    """The pooling a model declares (the module's order), mean when it declares none."""
    if gguf_fields is not None and (found := from_gguf_fields(gguf_fields)) is not None:
        return found
    for directory in model_dirs:
        path = directory / "1_Pooling" / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and (found := from_sentence_transformers(config)) is not None:
            return found
    if (found := from_architecture(hf_config or {}, name)) is not None:
        return found
    return DeclaredPooling("mean", "default")


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: Pooling) -> torch.Tensor:
    """[B, T, H] right-padded hidden states, each row's real length in `lengths` [B] -> [B, H]
    in float32: the mean of a row's first `length` states, its first (cls) or its last one."""
    hidden = hidden.float()
    lengths = lengths.to(hidden.device)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if mode != "mean":
        raise ValueError(f"unknown pooling {mode!r}: one of {', '.join(POOLINGS)}")
    keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
    summed = (hidden * keep[..., None]).sum(dim=1)
    return summed / lengths[:, None].to(hidden.dtype)


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Each row scaled to unit L2 length (a zero row stays zero)."""
    return torch.nn.functional.normalize(vectors.float(), p=2.0, dim=-1)


def shorten(vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """OpenAI's `dimensions`: the first `dimensions` values of each row, re-normalised to unit
    length; the rows (normalised) unchanged when None."""
    if dimensions is not None:
        vectors = vectors[..., :dimensions]
    return normalize(vectors)
