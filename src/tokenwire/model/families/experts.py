"""What the mixture-of-experts families share: their checkpoints' expert tensors under one naming,
and the names of a layer's router and experts.

Checkpoints name experts three ways: per expert `mlp.experts.E.{gate,up,down}_proj` (Qwen3-MoE,
OLMoE), per expert `block_sparse_moe.experts.E.{w1,w3,w2}` with the router at
`block_sparse_moe.gate` (Mixtral), and transformers >= 5's fused `mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden] (gate rows first) and `mlp.experts.down_proj`. `prepare`
brings all three to the first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from tokenwire.model.config import ModelConfig
from tokenwire.model.families.base import GgufMeta
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.mlp import MixtureOfExperts
from tokenwire.model.layers.weights import Tensors, WeightNames

_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_NAME = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|gate)\.")


def _renamed(key: str) -> str:
    def sub(m: re.Match[str]) -> str:
        return ".mlp.gate." if m.group(1) is None else f".mlp.experts.{m.group(1)}.{_MIXTRAL[m.group(2)]}."

    return _MIXTRAL_NAME.sub(sub, key)


class _ExpertsRenamed(Mapping[str, torch.Tensor]):
    """`state` under the per-expert `mlp.experts.E.{gate,up,down}_proj` names, read only when
    asked for: a GGUF's tensors are read from the file on access, and reading them all here
    held the whole model in memory twice (OLMoE-1B-7B Q4_K_M: 8.4 GB peak for a 4 GB file)."""

    def __init__(self, state: Tensors, experts: int) -> None:
        self.state = state
        # our name -> (the state's name, the expert or None, gate / up half or the whole of it)
        self.where: dict[str, tuple[str, int | None, str]] = {}
        for key in state:  # names only
            if key.endswith(".mlp.experts.gate_up_proj"):  # [experts, 2 x intermediate, hidden]
                prefix = key[: -len("gate_up_proj")]
                for e in range(experts):
                    self.where[f"{prefix}{e}.gate_proj.weight"] = (key, e, "gate")
                    self.where[f"{prefix}{e}.up_proj.weight"] = (key, e, "up")
            elif key.endswith(".mlp.experts.down_proj"):  # [experts, hidden, intermediate]
                prefix = key[: -len("down_proj")]
                for e in range(experts):
                    self.where[f"{prefix}{e}.down_proj.weight"] = (key, e, "whole")
            else:
                self.where[_renamed(key)] = (key, None, "whole")

    def __getitem__(self, name: str) -> torch.Tensor:
        key, expert, part = self.where[name]
        tensor = self.state[key]
        if expert is None:
            return tensor
        tensor = tensor[expert]
        if part == "whole":
            return tensor
        half = tensor.shape[0] // 2
        return tensor[:half] if part == "gate" else tensor[half:]

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def renamed(state: Tensors, experts: int) -> Tensors:
    """`state` with its `experts` experts under the per-expert names (read when asked for)."""
    return _ExpertsRenamed(state, experts)


def prepare(model: DecoderModel, state: Tensors, dtype: torch.dtype, device: torch.device) -> Tensors:
    return renamed(state, count(model.config))


def expert_names(config: ModelConfig, names: WeightNames, layer: int) -> WeightNames:
    """Layer `layer`'s MLP entries in `names` replaced by its router's and experts'."""
    hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
    del names[ours + "gate_up"], names[ours + "down"]
    names[ours + "router"] = (hf + "gate",)
    for e in range(count(config)):
        names[f"{ours}experts.{e}.gate_up"] = (f"{hf}experts.{e}.gate_proj", f"{hf}experts.{e}.up_proj")
        names[f"{ours}experts.{e}.down"] = (f"{hf}experts.{e}.down_proj",)
    return names


def count(config: ModelConfig) -> int:
    """The number of experts: `num_experts` in Qwen's and OLMoE's config.json, `num_local_experts`
    in Mixtral's (and in what transformers >= 5 writes for all three)."""
    return int(config.hf.get("num_local_experts") or config.hf.get("num_experts") or 0)


def moe(
    config: ModelConfig, intermediate: int, experts: int, top_k: int, normalize: bool
) -> MixtureOfExperts:
    return MixtureOfExperts(config.hidden_size, intermediate, experts, top_k, normalize, config.hidden_act)


def gguf_config(meta: GgufMeta, normalize: bool) -> dict[str, object]:
    """Qwen's and OLMoE's expert entries from a GGUF: counts from the metadata, each expert's
    width from its stacked tensor, which layers are sparse from where experts are, and the
    top-k normalisation llama.cpp applies for the family (`expert_weights_norm` where written)."""
    sparse = meta.layers_with("ffn_gate_exps")
    if not sparse:
        raise ValueError(f"GGUF metadata counts {meta.arch} experts but no layer has ffn_gate_exps tensors")
    n = meta.need("block_count")
    return {
        "num_experts": meta.need("expert_count"),
        "num_experts_per_tok": meta.need("expert_used_count"),
        "moe_intermediate_size": meta.shapes[f"blk.{sparse[0]}.ffn_gate_exps.weight"][1],
        "norm_topk_prob": bool(meta.get("expert_weights_norm", normalize)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n) if i not in sparse],
    }
