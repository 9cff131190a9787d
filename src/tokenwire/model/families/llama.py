"""Llama 2/3 (with llama3 rope scaling), SmolLM2 and Mistral: the plain Llama block; Mistral's
`sliding_window`, where its config sets one, windows every layer."""

from __future__ import annotations

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import Family, GgufNames, llama_layer, llama_names, sliding_windows
from tokenwire.model.layers.block import DecoderLayer


def assemble(config: ModelConfig) -> list[DecoderLayer]:
    windows = sliding_windows(config, every_layer=config.architecture == "MistralForCausalLM")
    return [llama_layer(config, i, window=windows[i]) for i in range(config.num_layers)]


FAMILY = Family(
    name="llama",
    architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"},
    assemble=assemble,
    weight_names=llama_names,
    gguf=GgufNames("llama", "llama", permuted_qk=True),
)
