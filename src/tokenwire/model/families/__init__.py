"""The model families tokenwire runs, one small file each over model/layers/.

`read_config` finds a config.json's family and reads it; `build_model` assembles that family's
stack and loads a checkpoint into it (float, or quantised blocks with `qtypes`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError
from tokenwire.model.families import (
    gemma3,
    llama,
    mixtral,
    olmoe,
    phi3,
    qwen2,
    qwen2_vl,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tokenwire.model.families.base import Family
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.weights import Tensors, WeightNames, load_weights, meta_init_skipped
from tokenwire.model.weight_arena import return_freed_memory

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, qwen2.FAMILY, qwen2_vl.FAMILY, qwen3.FAMILY, smollm3.FAMILY, phi3.FAMILY, gemma3.FAMILY,
    mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY,
)  # fmt: skip
ARCHITECTURES = {arch: family for family in FAMILIES for arch in family.architectures}
MODEL_TYPES = {model_type: arch for family in FAMILIES for arch, model_type in family.architectures.items()}
GGUF_FAMILIES: dict[str, list[Family]] = {}
for _family in FAMILIES:
    if _family.gguf is not None:
        GGUF_FAMILIES.setdefault(_family.gguf.architecture, []).append(_family)


def read_config(d: dict[str, Any]) -> ModelConfig:
    archs = d.get("architectures") or []
    model_type = str(d.get("model_type", "unknown"))
    arch = archs[0] if archs else MODEL_TYPES.get(model_type, model_type)
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {arch!r}: tokenwire implements {supported}"
        )
    return ARCHITECTURES[arch].read_config(d, arch)


def family_of(config: ModelConfig) -> Family:
    return ARCHITECTURES[config.architecture]


def build_model(
    config: ModelConfig,
    tensors: Tensors,
    qtypes: dict[str, int] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    stream_layers: bool = False,
) -> DecoderModel:
    """`qtypes`: the block type of each quantised tensor (a GGUF's own blocks, or weights
    quantised at load); those stay quantised, fp32 only, on the CPU. `stream_layers` (float
    weights): each decoder layer's weights are read from `tensors` as the layer runs and dropped
    after it, so a model larger than memory runs a layer at a time (`bench quality`'s fp32
    reference: OLMoE-1B-7B is 28 GB in fp32; `tensors` must then stay readable, as a GGUF's do)."""
    if stream_layers and qtypes:
        raise ValueError("stream_layers runs float weights; quantised ones are resident anyway")
    family = family_of(config)
    with meta_init_skipped():
        with torch.device("meta"):
            model = family.model_class(
                config, family.assemble(config), max_positions, **family.model_options(config)
            )
        if family.prepare is not None:
            tensors = family.prepare(model, tensors, dtype, torch.device(device))
        names = family.weight_names(config)
        tie = None
        if config.tie_word_embeddings or "lm_head.weight" not in tensors:
            names.pop("lm_head", None)
            tie = ("embed", "lm_head")
        if stream_layers:
            names = _stream_layers(model, names, tensors, dtype, device)
        load_weights(
            model, names, tensors, qtypes, dtype=dtype, device=device, tie=tie, complete=not stream_layers
        )
    model.finish_build(device)
    return model.eval().requires_grad_(False)


def _stream_layers(
    model: DecoderModel, names: WeightNames, tensors: Tensors, dtype: torch.dtype, device: str | torch.device
) -> WeightNames:
    """Hooks that load each decoder layer's weights before it runs and put them back on the meta
    device after; the names left to load now (the embeddings, the final norm, the head)."""
    by_layer: dict[int, WeightNames] = {i: {} for i in range(len(model.layers))}
    rest: WeightNames = {}
    for path, stems in names.items():
        head, _, tail = path.partition(".")
        if head == "layers":
            by_layer[int(tail.partition(".")[0])][path] = stems
        else:
            rest[path] = stems

    def drop(module: nn.Module, args: Any, output: Any) -> None:
        module.to("meta")
        return_freed_memory()

    for i, layer in enumerate(model.layers):

        def load(module: nn.Module, args: Any, own: WeightNames = by_layer[i]) -> None:
            with meta_init_skipped():
                load_weights(model, own, tensors, dtype=dtype, device=device, complete=False)

        layer.register_forward_pre_hook(load)
        layer.register_forward_hook(drop)
    return rest
