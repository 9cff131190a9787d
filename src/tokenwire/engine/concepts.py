"""Concept readout vectors: per-layer directions in the residual stream, read out by dot product.

Layer convention: layer ``L`` is the residual stream after ``L`` decoder blocks (``0`` = the
embedding output), i.e. index ``L`` of transformers' ``output_hidden_states`` tuple; valid layers
of a model with ``num_layers`` blocks are ``0..num_layers`` inclusive.

File format (safetensors): tensor ``"vectors"`` float32 [n_layers, n_concepts, hidden], tensor
``"layers"`` int64 [n_layers], metadata ``{"format": "tokenwire.concepts.v1", "names": <JSON list>}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["FORMAT", "ConceptSet", "build_concept"]

FORMAT = "tokenwire.concepts.v1"


@dataclass
class ConceptSet:
    """Named concept directions for a set of layers.

    ``vectors[i, j]`` is the direction of concept ``names[j]`` at layer ``layers[i]``.
    """

    names: list[str]
    layers: list[int]
    vectors: torch.Tensor  # float32 [n_layers, n_concepts, hidden]

    def __post_init__(self) -> None:
        self.names = [str(n) for n in self.names]
        self.layers = [int(layer) for layer in self.layers]
        self.vectors = self.vectors.detach().to(torch.float32)
        _validate(self.names, self.layers, self.vectors)

    @property
    def n_concepts(self) -> int:
        return len(self.names)

    @property
    def hidden_size(self) -> int:
        return int(self.vectors.shape[2])

    # ---- readout ---------------------------------------------------------------------------------

    def stack_layers(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pick this set's layers from a transformers-style ``hidden_states`` tuple.

        ``hidden_states[L]`` is [..., hidden]; returns [..., n_layers, hidden] ready for :meth:`project`.
        """
        if max(self.layers) >= len(hidden_states):
            n = len(hidden_states)
            raise ValueError(f"layer {max(self.layers)} requested but only {n} hidden states given")
        return torch.stack([hidden_states[layer] for layer in self.layers], dim=-2)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Dot products of hidden states with the concept vectors.

        ``hidden``: [P, n_layers, hidden] (any leading dims allowed), layer axis in ``self.layers``
        order. Returns float32 [P, n_layers, n_concepts] on ``hidden``'s device.
        """
        n_layers, _, h = self.vectors.shape
        if hidden.dim() < 2 or hidden.shape[-2] != n_layers or hidden.shape[-1] != h:
            raise ValueError(f"hidden must be [..., {n_layers}, {h}], got {list(hidden.shape)}")
        vec = self.vectors.to(hidden.device)
        return torch.einsum("...lh,lch->...lc", hidden.to(torch.float32), vec)

    # ---- combination -----------------------------------------------------------------------------

    def merge(self, other: ConceptSet) -> ConceptSet:
        """New set with ``other``'s concepts appended; layers and hidden size must be identical."""
        if other.layers != self.layers:
            raise ValueError(f"cannot merge with different layers: {self.layers} vs {other.layers}")
        if other.hidden_size != self.hidden_size:
            raise ValueError(f"cannot merge: hidden sizes {self.hidden_size} and {other.hidden_size} differ")
        dup = sorted(set(self.names) & set(other.names))
        if dup:
            raise ValueError(f"cannot merge: duplicate concept names {dup}")
        vectors = torch.cat([self.vectors, other.vectors.to(self.vectors.device)], dim=1)
        return ConceptSet(self.names + other.names, list(self.layers), vectors)

    # ---- persistence -----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        tensors = {
            "vectors": self.vectors.detach().cpu().contiguous(),
            "layers": torch.tensor(self.layers, dtype=torch.int64),
        }
        save_file(tensors, os.fspath(path), metadata={"format": FORMAT, "names": json.dumps(self.names)})

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], hidden_size: int | None = None, num_layers: int | None = None
    ) -> ConceptSet:
        """Load and validate a concept file.

        ``hidden_size``/``num_layers`` (the model's; optional) are checked against the file:
        vectors' last dim must equal ``hidden_size`` and every layer must be in ``0..num_layers``.
        Raises ValueError naming the problem (FileNotFoundError if the file does not exist).
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                keys = set(f.keys())
                missing = {"vectors", "layers"} - keys
                if missing:
                    raise ValueError(f"{path}: missing tensor(s) {sorted(missing)}")
                vectors = f.get_tensor("vectors")
                layers_t = f.get_tensor("layers")
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{path}: not a readable safetensors file: {e}") from e
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
        try:
            names = json.loads(meta["names"])
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: metadata 'names' missing or not JSON") from e
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{path}: metadata 'names' must be a JSON list of strings")
        if layers_t.dtype != torch.int64 or layers_t.dim() != 1:
            got = f"{layers_t.dtype} {list(layers_t.shape)}"
            raise ValueError(f"{path}: 'layers' must be a 1-D int64 tensor, got {got}")
        if not vectors.is_floating_point():
            raise ValueError(f"{path}: 'vectors' must be floating point, got {vectors.dtype}")
        try:
            cs = cls(names, layers_t.tolist(), vectors)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        if hidden_size is not None and cs.hidden_size != hidden_size:
            raise ValueError(f"{path}: hidden size {cs.hidden_size} does not match the model's {hidden_size}")
        if num_layers is not None and max(cs.layers) > num_layers:
            raise ValueError(
                f"{path}: layer {max(cs.layers)} out of range for a model with {num_layers} layers "
                f"(valid: 0..{num_layers})"
            )
        return cs


def _validate(names: list[str], layers: list[int], vectors: torch.Tensor) -> None:
    if vectors.dim() != 3:
        raise ValueError(f"vectors must be 3-D [n_layers, n_concepts, hidden], got {list(vectors.shape)}")
    if not names:
        raise ValueError("a concept set needs at least one concept name")
    if not layers:
        raise ValueError("a concept set needs at least one layer")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate concept names: {names}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"duplicate layers: {layers}")
    if min(layers) < 0:
        raise ValueError(f"layers must be >= 0, got {layers}")
    if vectors.shape[0] != len(layers):
        raise ValueError(f"vectors has {vectors.shape[0]} layer rows but {len(layers)} layers are listed")
    if vectors.shape[1] != len(names):
        raise ValueError(f"vectors has {vectors.shape[1]} concept columns but {len(names)} names are listed")
    if vectors.shape[2] == 0:
        raise ValueError("hidden size must be positive")


def build_concept(
    name: str,
    positive: dict[int, torch.Tensor],
    negative: dict[int, torch.Tensor],
    *,
    normalize: bool = True,
) -> ConceptSet:
    """Difference-of-means concept: per layer, ``mean(positive) - mean(negative)``.

    ``positive``/``negative`` map layer -> activations [N, hidden] (N >= 1; the two N may differ)
    and must cover the same layers. Layers are sorted ascending in the result. With
    ``normalize=True`` (default) each layer's vector is scaled to unit L2 norm, so
    :meth:`ConceptSet.project` gives the component of the hidden state along the concept
    direction; a zero difference then raises ValueError.
    """
    if set(positive) != set(negative):
        raise ValueError(
            f"positive and negative have different layers: {sorted(positive)} vs {sorted(negative)}"
        )
    if not positive:
        raise ValueError("no layers given")
    layers = sorted(int(layer) for layer in positive)
    rows = []
    for layer in layers:
        pos, neg = positive[layer], negative[layer]
        for kind, t in (("positive", pos), ("negative", neg)):
            if t.dim() != 2 or t.shape[0] == 0:
                shape = list(t.shape)
                raise ValueError(f"{kind} activations at layer {layer} must be [N>=1, hidden], got {shape}")
        if pos.shape[1] != neg.shape[1]:
            raise ValueError(f"hidden sizes differ at layer {layer}: {pos.shape[1]} vs {neg.shape[1]}")
        v = pos.to(torch.float64).mean(0) - neg.to(torch.float64).mean(0)
        if normalize:
            norm = v.norm()
            if norm == 0:
                raise ValueError(f"positive and negative means are identical at layer {layer}")
            v = v / norm
        rows.append(v.to(torch.float32).cpu())
    if len({r.shape[0] for r in rows}) != 1:
        raise ValueError("hidden size differs between layers")
    return ConceptSet([name], layers, torch.stack(rows).unsqueeze(1))
