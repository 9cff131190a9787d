"""SmolLM3: the Llama block; the layers `no_rope_layers` marks 0 (every fourth) use no RoPE."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import Family, config_rope, llama_layer, llama_names, sliding_windows
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


FAMILY = Family(
    name="smollm3",
    architectures={"SmolLM3ForCausalLM": "smollm3"},
    assemble=assemble,
    weight_names=llama_names,
)
