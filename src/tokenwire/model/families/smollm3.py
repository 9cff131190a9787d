"""SmolLM3: the Llama block; the layers `no_rope_layers` marks 0 (every fourth) use no RoPE."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import (
    Family,
    GgufNames,
    config_rope,
    llama_layer,
    llama_names,
    sliding_windows,
)
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.rotary import RopeSpec


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    n = config.num_layers
    interval = int(config.hf.get("no_rope_layer_interval") or 4)
    uses_rope = config.hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    none = RopeSpec.make("none", config.rope_theta, config.head_dim)
    windows = sliding_windows(config)
    return [
        llama_layer(config, i, config_rope(config) if uses_rope[i] else none, window=windows[i])
        for i in range(n)
    ]


# llama.cpp converts SmolLM3 as a Llama (q/k rows interleaved) and skips RoPE on every fourth
# layer without saying so in the file (its n_no_rope_layer_step is fixed at 4)
GGUF = GgufNames("smollm3", "smollm3", permuted_qk=True, config=lambda meta: {"no_rope_layer_interval": 4})

FAMILY = Family(
    name="smollm3",
    architectures={"SmolLM3ForCausalLM": "smollm3"},
    assemble=assemble,
    weight_names=llama_names,
    gguf=GGUF,
)
