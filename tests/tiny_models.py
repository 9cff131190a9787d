"""Random-weight tiny configs of each supported architecture, built with transformers."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

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
