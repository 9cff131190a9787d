"""Mixture-of-experts checkpoints name their experts three ways (families/experts.py): the
published per-expert layouts load into the same model as transformers >= 5's fused tensors."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_llama_parity import dense_logits
from tests.tiny_models import hf_model
from tokenwire.model.families import build_model, read_config


def per_expert(state: dict[str, torch.Tensor], mixtral: bool) -> dict[str, torch.Tensor]:
    """transformers >= 5's fused expert tensors rewritten as a published checkpoint has them."""
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for key, t in state.items():
        block = key.replace(".mlp.", ".block_sparse_moe.") if mixtral else key
        if key.endswith("mlp.experts.gate_up_proj"):
            base, half = block[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.{names[0]}.weight"] = t[e, :half].clone()
                out[f"{base}{e}.{names[1]}.weight"] = t[e, half:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{block[: -len('down_proj')]}{e}.{names[2]}.weight"] = t[e].clone()
        else:
            out[block if key.endswith("mlp.gate.weight") else key] = t
    return out


@pytest.mark.parametrize(("arch", "mixtral"), [("mixtral", True), ("qwen3_moe", False)])
def test_published_expert_layouts_load_like_fused_ones(arch: str, mixtral: bool) -> None:
    hf = hf_model(arch)
    config = read_config(hf.config.to_dict())
    fused = build_model(config, dict(hf.state_dict()))
    published = per_expert(dict(hf.state_dict()), mixtral)
    assert not any(k.endswith("gate_up_proj") for k in published)
    assert any(".block_sparse_moe.experts.0.w1." in k for k in published) == mixtral
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(4))
    assert torch.equal(dense_logits(build_model(config, published), ids), dense_logits(fused, ids))


class _CountingReads(dict):
    """A state whose reads are counted: a GGUF's tensors are read from the file on access."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.reads: list[str] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads.append(key)
        return super().__getitem__(key)

    def items(self):  # dict's own items() would bypass __getitem__
        return ((k, self[k]) for k in self)


@pytest.mark.parametrize(("arch", "mixtral"), [("mixtral", True), ("olmoe", False)])
def test_renaming_experts_reads_each_tensor_only_when_the_load_asks(arch: str, mixtral: bool) -> None:
    """Renaming the experts must not read the checkpoint: it read every tensor into a dict, which
    for a GGUF held the whole file in memory beside the loaded weights (OLMoE-1B-7B Q4_K_M: an
    8.4 GB peak for a 4 GB file)."""
    from tokenwire.model.families import experts, family_of

    hf = hf_model(arch)
    config = read_config(hf.config.to_dict())
    for state in (dict(hf.state_dict()), per_expert(dict(hf.state_dict()), mixtral)):
        counted = _CountingReads(state)
        with torch.device("meta"):
            family = family_of(config)
            model = family.model_class(config, family.assemble(config), None, **family.model_options(config))
        renamed = experts.prepare(model, counted, torch.float32, torch.device("cpu"))
        assert counted.reads == []
        assert set(renamed) == set(per_expert(dict(hf.state_dict()), False))  # one naming
        built = build_model(config, counted)
        assert set(counted.reads) == set(state)
        ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(5))
        reference = build_model(config, dict(hf.state_dict()))
        assert torch.equal(dense_logits(built, ids), dense_logits(reference, ids))
