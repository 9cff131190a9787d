"""A tiny transformers model written to GGUF the way llama.cpp's convert_hf_to_gguf.py writes its
family (read from its conversion/ sources; gguf-py's own tensor-name map, not ours):

- Llama, Mixtral, SmolLM3: q/k rows permuted for llama.cpp's interleaved RoPE;
- every family: experts stacked into one [experts, rows, cols] tensor per projection, the
  metadata keys of gguf-py's writer (`{arch}.expert_count`, `.expert_feed_forward_length`, ...);
- Gemma 3: each norm weight stored plus 1, the tied lm_head dropped, `sliding_window`,
  `final_logit_softcapping`, the local layers' `rope.freq_base_swa`, linear scaling of the global
  ones; layers windowed in llama.cpp's fixed pattern (every sixth global), which the file does
  not record;
- Phi-3: fused qkv and gate_up kept, LongRoPE as `rope_factors_long/short` tensors plus the
  attention factor and original context length in the metadata (no scaling type), `sliding_window`
  0 for none.

Matrices go to `quant` (F32 or a gguf-py block type), 1-D tensors and MoE routers stay F32, as the
converter keeps them. test_family_gguf holds the metadata and tensor table written here to those
the real converter wrote for the same models (tests/data/make_converter_tables.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quantize as gguf_quantize

from tokenwire.bench.shapes import copy_shipped_tokenizer

# HF architecture -> (gguf-py's architecture, q/k rows permuted)
ARCHES = {
    "LlamaForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "MixtralForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "SmolLM3ForCausalLM": (gguf.MODEL_ARCH.SMOLLM3, True),
    "Qwen3ForCausalLM": (gguf.MODEL_ARCH.QWEN3, False),
    "Qwen3MoeForCausalLM": (gguf.MODEL_ARCH.QWEN3MOE, False),
    "OlmoeForCausalLM": (gguf.MODEL_ARCH.OLMOE, False),
    "Phi3ForCausalLM": (gguf.MODEL_ARCH.PHI3, False),
    "Gemma3ForCausalLM": (gguf.MODEL_ARCH.GEMMA3, False),
}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 fuses gate and up ([experts, 2 x ff, hidden]); the converter splits them
    into stacked gate / up / down tensors under the per-expert names gguf-py maps."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t[:, :half], t[:, half:]
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    return out


def _rope(c, family: str) -> dict[str, dict]:
    params = getattr(c, "rope_parameters", None) or {}
    return params if family == "gemma3" else {"full_attention": params}


def write_like_llama_cpp(
    hf: torch.nn.Module,
    path: Path,
    quant: str = "F32",
    chat_template: str | None = None,
    drop: str = "",
    tokenizer: bool = True,
) -> None:
    """`drop`: a metadata key (after the architecture) left out, as a damaged file would.
    `tokenizer=False`: no tokenizer fields (a file only to compare the model's own metadata and
    tensors: gguf-py's reader takes ~6 s over the shipped vocabulary's 49,152 strings and merges)."""
    c = hf.config
    arch, permuted = ARCHES[type(hf).__name__]
    name = gguf.MODEL_ARCH_NAMES[arch]
    family = c.model_type.replace("_text", "")
    w = gguf.GGUFWriter(str(path), name)
    if drop:
        add_uint32 = w.add_uint32
        w.add_uint32 = lambda key, value: None if key == f"{name}.{drop}" else add_uint32(key, value)  # type: ignore[method-assign]
    if tokenizer:
        assert copy_shipped_tokenizer(w, chat_template) == c.vocab_size
    stated_head_dim = c.to_dict().get("head_dim")  # the converter writes key/value lengths only then
    head_dim = stated_head_dim or c.hidden_size // c.num_attention_heads
    for key, value in {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": stated_head_dim,
        "attention.value_length": stated_head_dim,
        # written by the Llama-derived classes (Mixtral and SmolLM3 among them) and Phi-3's
        "rope.dimension_count": head_dim if permuted or family == "phi3" else None,
        "vocab_size": c.vocab_size if permuted else None,
    }.items():
        if value is not None:
            w.add_uint32(f"{name}.{key}", value)
    w.add_float32(f"{name}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = _rope(c, family)
    full = rope["full_attention"]
    w.add_float32(f"{name}.rope.freq_base", full["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_string(f"{name}.rope.scaling.type", "linear")
        w.add_float32(f"{name}.rope.scaling.factor", full["factor"])
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_uint32(f"{name}.expert_count", experts)
        w.add_uint32(f"{name}.expert_used_count", c.num_experts_per_tok)
    if family == "qwen3_moe":
        w.add_uint32(f"{name}.expert_feed_forward_length", c.moe_intermediate_size)
    if family == "gemma3":
        w.add_uint32(f"{name}.attention.sliding_window", c.sliding_window)
        w.add_float32(f"{name}.final_logit_softcapping", c.final_logit_softcapping)
        w.add_float32(f"{name}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    if family == "phi3":
        original = c.original_max_position_embeddings
        w.add_uint32(f"{name}.rope.scaling.original_context_length", original)
        w.add_uint32(f"{name}.attention.sliding_window", c.sliding_window or 0)
        scale = c.max_position_embeddings / original
        w.add_float32(f"{name}.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(full[f"{kind}_factor"], dtype=np.float32))

    to_gguf = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for hf_name, tensor in _stacked_experts(dict(hf.state_dict())).items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp reads the embedding table
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")) and permuted:
            heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
            tensor = _permute(tensor, heads)
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            tensor = tensor + 1
        stem, kind = hf_name.rsplit(".", 1)
        target, data = f"{to_gguf.get_name(stem)}.{kind}", tensor.detach().numpy().astype(np.float32)
        router = target.endswith("ffn_gate_inp.weight")  # kept F32 by the converter and llama-quantize
        if data.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and not router:
            w.add_tensor(target, gguf_quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(target, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
