"""Rotary position embeddings, one table per distinct `RopeSpec` of a model (a layer names which).

Kinds: `default`; `linear` (positions divided by `factor`: Gemma 3's global layers); `llama3`
(Llama 3.1's long-wavelength scaling); `longrope` (Phi-3's per-frequency
factors, the long set when the model runs past its original context, as llama.cpp picks them);
`mrope` (Qwen2-VL's three position rows over frequency bands, positions given per step); `none`
(a layer without RoPE, SmolLM3's every fourth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [N, 1, head_dim] each


@dataclass(frozen=True)
class RopeSpec:
    kind: str = "default"  # default | linear | llama3 | longrope | mrope | none
    theta: float = 10000.0
    dim: int = 64  # the head dimension (rotated in full)
    # the scaling parameters as sorted (key, value) pairs, lists as tuples: hashable, so equal
    # specs of different layers share one table
    scaling: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, kind: str, theta: float, dim: int, scaling: dict[str, Any] | None = None) -> RopeSpec:
        items = sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (scaling or {}).items())
        return cls(kind, float(theta), dim, tuple(items))

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.scaling).get(key, default)


def inv_freq(spec: RopeSpec, max_positions: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos/sin are multiplied by (LongRoPE's attention
    factor; 1 otherwise)."""
    dim = spec.dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (spec.theta**exponents)
    if spec.kind == "llama3":
        return _llama3(base, spec), 1.0
    if spec.kind == "linear":
        return base / float(spec.param("factor", 1.0)), 1.0
    if spec.kind == "longrope":
        original = int(spec.param("original_max_position_embeddings"))
        factors = spec.param("long_factor" if max_positions > original else "short_factor")
        freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta**exponents)
        # the factor the model was trained to (config.json's max_position_embeddings / original)
        factor = spec.param("factor") or spec.param("max_position_embeddings", max_positions) / original
        attention = spec.param("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return freq, float(attention)
    return base, 1.0


def _llama3(freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # long wavelengths are divided by `factor`, short ones kept, and the band in between is
    # interpolated smoothly (Llama 3.1 rope_scaling in config.json)
    factor = float(spec.param("factor"))
    low = float(spec.param("low_freq_factor", 1.0))
    high = float(spec.param("high_freq_factor", 4.0))
    old_context = float(spec.param("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_context / low, freq / factor, freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _signed(freqs: torch.Tensor, factor: float) -> RopeTables:
    """cos and sin of [.., D/2] angles in the rotate-half layout, the sign of rotate_half folded
    into sin: rotate_half(x) = cat(-x2, x1) = roll(x, D/2) with the first half negated."""
    emb = torch.cat([freqs, freqs], dim=-1)
    half = emb.shape[-1] // 2
    ones = torch.ones(half, device=freqs.device)  # on the angles' device: CUDA steps failed (d054c5b)
    sign = torch.cat([-ones, ones])
    return emb.cos() * factor, emb.sin() * (sign * factor)


class Rotary(nn.Module):
    """cos and sin of the step's positions' angles, computed per step as llama.cpp does: a table
    for every position held [max_positions, D] twice (Gemma 3 1B's two, at 32k positions and heads
    of 256: 128 MiB, a start's peak past file + KV + 300 MB). The values are the table's: an
    angle is the same fp32 product, and torch's cos/sin give an element the same bits whatever
    the tensor's shape."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        freq, self.factor = inv_freq(spec, max_positions)
        self.register_buffer("freq", freq, persistent=False)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.to(torch.float32)[:, None] * self.freq

    def half_tables(self, positions: torch.Tensor) -> RopeTables:
        """cos and sin [N, D/2] of the D/2 angles at `positions` (the fused kernel's form: the
        rotate-half layout repeats them in both halves)."""
        angles = self._angles(positions)
        return angles.cos() * self.factor, angles.sin() * self.factor

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, mrope: torch.Tensor | None) -> RopeTables:
        cos, sin = _signed(self._angles(positions), self.factor)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class MRotary(nn.Module):
    """M-RoPE: frequency band i rotates by position row i % 3 (temporal, height, width); the rows
    come with each step (`mrope` [3, N]; None: text only, the slot positions in every row)."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        sections = spec.param("mrope_section")
        half = spec.dim // 2
        if sections is None or sum(sections) != half:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {half}")
        with torch.device("cpu"):  # plain CPU tensors, also after a meta-device construction
            self.rows = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(sections)])
            self.freq = inv_freq(RopeSpec("default", spec.theta, spec.dim), max_positions)[0]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, mrope: torch.Tensor | None) -> RopeTables:
        pos3 = mrope if mrope is not None else positions.expand(3, -1)
        freqs = pos3.cpu()[self.rows].T.float() * self.freq  # fp32 angles, as the reference
        cos, sin = _signed(freqs, 1.0)
        return cos[:, None].to(positions.device, dtype), sin[:, None].to(positions.device, dtype)


def make_rotary(spec: RopeSpec, max_positions: int) -> nn.Module | None:
    if spec.kind == "none":
        return None
    return (MRotary if spec.kind == "mrope" else Rotary)(spec, max_positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # two multiplies and an add, not addcmul: the fused multiply-add rounds differently from
    # the reference implementation and the difference grows through 30 layers
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
