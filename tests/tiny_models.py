"""Random-weight tiny configs of each supported architecture, built with transformers."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from tokenwire.model.families import build_model, read_config
from tokenwire.model.layers.decoder import DecoderModel

VOCAB = 49152  # SmolLM2's, so the real tokenizer can drive the tiny models


def _common(**kw: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return base


def _gemma3(**kw: object) -> Gemma3TextConfig:
    """A tiny Gemma 3: head size 16, a window of 8, local layers at RoPE base 10k, global ones at
    1M with linear scaling, the final soft-cap; `kw` its layers and query scale."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    }
    common = _common(
        head_dim=16, sliding_window=8, final_logit_softcapping=15.0, rope_parameters=rope, pad_token_id=0
    )
    return Gemma3TextConfig(**{**common, **kw})


TINY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama2": LlamaConfig(**_common(rope_theta=10000.0)),
    "llama3": LlamaConfig(
        **_common(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ),
    "mistral": MistralConfig(**_common(sliding_window=None)),
    "qwen2": Qwen2Config(**_common(num_key_value_heads=1, use_sliding_window=False)),
    "smollm2": LlamaConfig(
        **_common(tie_word_embeddings=True, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    ),
    # head sizes the fused attention takes in other register shapes: 128 (Llama 3 8B's) and 48
    "llama_d128": LlamaConfig(**_common(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)),
    "llama_d48": LlamaConfig(**_common(hidden_size=96, num_attention_heads=2, num_key_value_heads=1)),
    # issue 25's families, each with the parts that set it apart: Qwen3's per-head q/k norm (and a
    # sliding window from layer 1 on), SmolLM3's layer without RoPE, Gemma 3's (1 + w) sandwich
    # norms, scaled embeddings, query pre-scale, GELU-tanh, windowed local layers with their own
    # RoPE base, linear RoPE scaling on the global ones, final soft-capping (its attention cap
    # is a config field transformers' Gemma 3 never applies: set, so we must ignore it too),
    # Phi-3's fused checkpoint tensors and LongRoPE (past its original 16 positions: long factors)
    "qwen3": Qwen3Config(**_common(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "smollm3": SmolLM3Config(**_common(num_hidden_layers=4, pad_token_id=None, no_rope_layer_interval=4)),
    "gemma3": _gemma3(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        attn_logit_softcapping=20.0,
    ),
    # as a GGUF can hold them: llama.cpp runs Qwen3 without a window and Qwen3-MoE with experts
    # in every layer, fixes Gemma 3's every sixth layer global and scales its q.k by head_dim^-1/2
    # (the file records none of these)
    "qwen3_gguf": Qwen3Config(**_common()),
    "qwen3_moe_gguf": Qwen3MoeConfig(
        **_common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    ),
    "gemma3_gguf": _gemma3(
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=16,
    ),
    # mixtures of experts: Mixtral's renormalised top-k, Qwen3-MoE's with a dense layer among
    # them (mlp_only_layers), OLMoE's raw top-k weights and q/k norms over whole projections
    "mixtral": MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": Qwen3MoeConfig(
        **_common(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    ),
    "olmoe": OlmoeConfig(**_common(num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
    "phi3": Phi3Config(
        **_common(
            original_max_position_embeddings=16,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [1.5 + 0.4 * i for i in range(8)],
            },
        )
    ),
}


def hf_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    cfg = TINY_CONFIGS[name]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: make them count
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf: torch.nn.Module, max_positions: int | None = None) -> DecoderModel:
    config = read_config(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items()}
    return build_model(config, state, max_positions=max_positions)
