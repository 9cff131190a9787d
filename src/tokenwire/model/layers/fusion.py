"""The fused decode kernel (kernels/decode_stack.h) fed from a model's layers.

Each layer is handed over as a description: its weights by role, its block types, window,
activation, norm epsilon and attention scale, and its rotary table (none for a layer without
RoPE). The kernel knows one layer shape: pre-norm attention with
optional bias and q/k norm (per head, or over the whole projection), 1-D RoPE, an optional sliding
window (the layer's keys and values in the cache's window pool where it keeps one), optional norms
on the attention's and the MLP's outputs (Gemma's sandwich), a gated dense MLP or a mixture of
gated experts under a float router, every projection quantised. A model with any other layer
decodes eager, and `blocker` says why (the bench prints it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tokenwire.model import kernels
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.mlp import GatedMLP, MixtureOfExperts
from tokenwire.model.layers.rotary import RopeSpec, Rotary
from tokenwire.model.quant import QuantLinear, StackedQuantLinear

ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}  # decode_stack.h's gated()
_STACKED = (QuantLinear, StackedQuantLinear)  # qkv and gate/up: parts may differ in type


def blocker(layers: Sequence[DecoderLayer], device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a stack's decode steps cannot fuse; None when they can."""
    if device.type != "cpu" or dtype != torch.float32:
        return "the fused decode runs fp32 weights on the CPU"
    first = layers[0].attention.spec
    for layer in layers:
        why = _layer_blocker(layer)
        if why is None and layer.attention.spec.num_heads != first.num_heads:
            why = "head counts differ between layers"
        if why is not None:
            return f"layer {layer.index}: {why}"
    return None


def _mlps(layer: DecoderLayer) -> list[nn.Module]:
    """The gated MLPs the layer runs: its own, or its experts."""
    mlp = layer.mlp
    return list(mlp.experts) if isinstance(mlp, MixtureOfExperts) else [mlp]


def _layer_blocker(layer: DecoderLayer) -> str | None:
    attention = layer.attention
    if not isinstance(layer.mlp, (GatedMLP, MixtureOfExperts)):
        return f"{type(layer.mlp).__name__} feed-forward"
    if isinstance(layer.mlp, MixtureOfExperts) and not isinstance(layer.mlp.router, nn.Linear):
        return "a quantised router (the kernel takes its float weights)"
    for mlp in _mlps(layer):
        if mlp.activation not in ACTIVATION_CODES:
            return f"activation {mlp.activation}"
        if mlp.down.in_features % 8:  # the kernel shares the gated activation out in vectors of 8
            return f"intermediate size {mlp.down.in_features} (not a multiple of 8)"
    pairs = [(attention.qkv, attention.o_proj), *((mlp.gate_up, mlp.down) for mlp in _mlps(layer))]
    if not all(isinstance(one, QuantLinear) and isinstance(stacked, _STACKED) for stacked, one in pairs):
        return "float projections (the kernel multiplies quantised blocks)"
    if attention.spec.softcap is not None:
        return "attention soft-capping"
    if layer.rope.kind not in ("default", "linear", "llama3", "longrope", "none"):
        return f"{layer.rope.kind} rotary positions"
    return None


def rope_order(rotaries: dict[RopeSpec, nn.Module | None]) -> list[RopeSpec]:
    """The specs whose cos/sin a fused step hands the kernel, in the order it takes them."""
    return [spec for spec, rotary in rotaries.items() if isinstance(rotary, Rotary)]


def describe(
    layer: DecoderLayer, rope: int
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, float]]:
    """`rope`: the index of the layer's cos/sin among a step's (rope_order), -1 for none."""
    attention, mlp, spec = layer.attention, layer.mlp, layer.attention.spec
    projections: dict[str, nn.Module] = {"qkv": attention.qkv, "o": attention.o_proj}
    tensors: dict[str, torch.Tensor] = {}
    ints: dict[str, int] = {}
    if isinstance(mlp, MixtureOfExperts):  # the router's float weights; each expert's projections
        tensors["router"] = mlp.router.weight.float()
        ints["top_k"], ints["normalize"] = mlp.top_k, int(mlp.normalize)
        for e, expert in enumerate(mlp.experts):
            projections[f"expert{e}.gate_up"], projections[f"expert{e}.down"] = expert.gate_up, expert.down
    else:
        projections["gate_up"], projections["down"] = mlp.gate_up, mlp.down
    for name, linear in projections.items():  # a stacked one's parts as qkv, qkv@1, ... (Proj)
        parts = linear.parts if isinstance(linear, StackedQuantLinear) else [linear]
        for i, part in enumerate(parts):
            suffix = f"@{i}" if i else ""
            tensors[name + suffix], ints[f"{name}_type{suffix}"] = part.packed, int(part.qtype)
    tensors["attn_norm"], tensors["mlp_norm"] = layer.attn_norm.scale(), layer.mlp_norm.scale()
    if layer.attn_out_norm is not None:
        tensors["attn_out_norm"] = layer.attn_out_norm.scale()
    if layer.mlp_out_norm is not None:
        tensors["mlp_out_norm"] = layer.mlp_out_norm.scale()
    if attention.qkv.bias is not None:
        tensors["qkv_bias"] = attention.qkv.bias
    if attention.q_norm is not None and attention.k_norm is not None:
        tensors["q_norm"], tensors["k_norm"] = attention.q_norm.scale(), attention.k_norm.scale()
        ints["qk_norm_whole"] = int(not spec.qk_norm_per_head)
    ints["rope"] = rope
    ints["window"] = spec.window or 0
    ints["activation"] = ACTIVATION_CODES[_mlps(layer)[0].activation]
    # scale 0: the kernel's own 1/sqrt(D) in float, as before descriptions existed (bit for bit)
    floats = {"eps": layer.attn_norm.eps, "scale": spec.scale or 0.0}
    return {k: v.contiguous() for k, v in tensors.items()}, ints, floats


def build_stack(
    layers: Sequence[DecoderLayer], rotaries: dict[RopeSpec, nn.Module | None], final_eps: float
) -> Any:
    """The kernel's handle on the layers' weights; `rotaries`: each RopeSpec's rotary (its cos/sin
    come with each step, in rope_order)."""
    kernels.ops()  # loads the kernels, which define the class
    spec = layers[0].attention.spec
    stack = torch.classes.tokenwire.DecodeStack(spec.num_heads, spec.num_kv_heads, spec.head_dim, final_eps)
    order = rope_order(rotaries)
    for layer in layers:
        stack.add_layer(*describe(layer, order.index(layer.rope) if layer.rope in order else -1))
    return stack
