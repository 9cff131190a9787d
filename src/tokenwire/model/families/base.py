"""What a family file declares: its architectures, how its config reads, its stack, its names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenwire.model.config import ModelConfig, common_config
from tokenwire.model.layers.attention import Attention, AttentionSpec
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.mlp import GatedMLP
from tokenwire.model.layers.rotary import RopeSpec
from tokenwire.model.layers.weights import Tensors, WeightNames

# llama.cpp's tensor names (convert_hf_to_gguf.py) -> Hugging Face's, per layer and global; a
# family whose GGUF has more tensors extends these
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# the per-head (Qwen3, Gemma 3) or whole-projection (OLMoE) q/k norms
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# a mixture of experts' router and stacked experts ([experts, rows, cols], one expert's rows
# after another's), each expert's slice read as the per-expert tensor it was stacked from
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}


@dataclass(frozen=True)
class GgufMeta:
    """What a GGUF says of its model: metadata, tensor shapes (rows first), small tensors' values."""

    arch: str  # general.architecture
    fields: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    values: Callable[[str], np.ndarray]  # a tensor's values as float32 (rope factors, not weights)
    path: Path | str = "<gguf>"

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> int:
        """An integer the family cannot do without; a file lacking it is refused by name."""
        value = self.fields.get(f"{self.arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"GGUF file {self.path}: metadata {self.arch}.{key} is missing or not an integer: {value!r}"
            )
        return value

    def layers_with(self, kind: str) -> list[int]:
        """The blocks holding a tensor of `kind` (ffn_gate_exps: the sparse layers)."""
        parts = (name.split(".") for name in self.shapes if name.startswith("blk."))
        return sorted({int(p[1]) for p in parts if p[2] == kind})


@dataclass(frozen=True)
class GgufNames:
    """How llama.cpp's convert_hf_to_gguf.py wrote a family: its architecture name, tensor names,
    what it did to the tensors, and the config.json entries its metadata gives beyond the common
    ones (`config`)."""

    architecture: str  # general.architecture
    model_type: str  # the HF model_type its config.json gets (one of the family's architectures')
    permuted_qk: bool  # llama.cpp's converter interleaved q/k rows for its RoPE (undone on reading)
    layer: dict[str, str] = field(default_factory=lambda: dict(GGUF_LAYER_NAMES))
    globals: dict[str, str] = field(default_factory=lambda: dict(GGUF_GLOBAL_NAMES))
    experts: bool = False  # the family's files have `{arch}.expert_count` (Mixtral shares "llama")
    norm_shift: float = 0.0  # added to every norm weight by the converter (Gemma's 1 + w), taken off
    config: Callable[[GgufMeta], dict[str, Any]] = lambda meta: {}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: dict[str, str]  # HF architecture -> its model_type
    assemble: Callable[[ModelConfig], list[DecoderLayer]]  # the layers of the stack
    weight_names: Callable[[ModelConfig], WeightNames]
    read_config: Callable[[dict[str, Any], str], ModelConfig] = common_config
    gguf: GgufNames | None = None
    model_class: type[DecoderModel] = DecoderModel  # a subclass holds more than the decoder (vision)
    # called before the decoder's weights load: loads what the names do not cover (a vision
    # tower) and returns the checkpoint's tensors under the names `weight_names` uses
    prepare: Callable[[DecoderModel, Tensors, torch.dtype, torch.device], Tensors] | None = None
    # the stack's own settings beyond its layers (DecoderModel's embed_scale, logit_softcap, norm_offset)
    model_options: Callable[[ModelConfig], dict[str, Any]] = lambda config: {}


def config_rope(config: ModelConfig) -> RopeSpec:
    """The rotary table config.json describes (rope_theta, rope_scaling)."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return RopeSpec.make(kind, config.rope_theta, config.head_dim, scaling)


def llama_layer(
    config: ModelConfig,
    index: int,
    rope: RopeSpec | None = None,
    mlp: nn.Module | None = None,
    **attention: Any,
) -> DecoderLayer:
    """The Llama block every family starts from; `mlp` replaces its dense MLP (a mixture of
    experts), `attention` overrides AttentionSpec fields."""
    spec = AttentionSpec(
        config.num_heads, config.num_kv_heads, config.head_dim, bias=config.attention_bias, **attention
    )
    return DecoderLayer(
        index,
        config.hidden_size,
        Attention(index, config.hidden_size, spec, config.rms_norm_eps),
        mlp or GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
        eps=config.rms_norm_eps,
        rope=rope or config_rope(config),
    )


def sliding_windows(config: ModelConfig, every_layer: bool = False) -> list[int | None]:
    """Each layer's window, as transformers reads config.json: `layer_types` where the config
    lists them (transformers >= 5 writes them); else Qwen's rule (`use_sliding_window`, from layer
    `max_window_layers` on); else, for a family that windows `every_layer` (Mistral, Phi-3),
    `sliding_window` on all of them."""
    hf, n = config.hf, config.num_layers
    window = hf.get("sliding_window")
    if window is None:
        return [None] * n
    if hf.get("layer_types"):
        return [int(window) if kind == "sliding_attention" else None for kind in hf["layer_types"]]
    if "use_sliding_window" in hf:
        first = int(hf.get("max_window_layers") or 0)
        return [int(window) if hf["use_sliding_window"] and i >= first else None for i in range(n)]
    return [int(window) if every_layer else None] * n


def qk_norm_names(config: ModelConfig, names: WeightNames) -> WeightNames:
    """`names` plus each layer's per-head q/k norm (Qwen3, Gemma 3)."""
    for i in range(config.num_layers):
        for part in "qk":
            names[f"layers.{i}.attention.{part}_norm"] = (f"model.layers.{i}.self_attn.{part}_norm",)
    return names


def llama_names(config: ModelConfig) -> WeightNames:
    """Llama's HF tensor names for the stack's modules (Qwen2, Mistral, SmolLM2 use the same)."""
    names: WeightNames = {"embed": ("model.embed_tokens",), "norm": ("model.norm",), "lm_head": ("lm_head",)}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names[ours + "attn_norm"] = (hf + "input_layernorm",)
        names[ours + "attention.qkv"] = tuple(hf + f"self_attn.{n}_proj" for n in "qkv")
        names[ours + "attention.o_proj"] = (hf + "self_attn.o_proj",)
        names[ours + "mlp_norm"] = (hf + "post_attention_layernorm",)
        names[ours + "mlp.gate_up"] = (hf + "mlp.gate_proj", hf + "mlp.up_proj")
        names[ours + "mlp.down"] = (hf + "mlp.down_proj",)
    return names
