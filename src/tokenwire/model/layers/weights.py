"""A family's checkpoint into its assembled stack: one name table, float or quantised weights.

A family lists, for every module of its stack that holds weights, the Hugging Face tensor names
that fill it (`WeightNames`); several names are concatenated by rows (q/k/v into one projection,
gate/up into one). The same table loads fp32/bf16 checkpoints and the quantised tensors of a GGUF
conversion or of `--weights int8|int4` (`qtypes`: the block type of each quantised tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.quant import Q8_0, QuantEmbedding, QuantLinear, dequantize, quantize
from tokenwire.model.weight_arena import move_to_huge_pages

# module path in the stack ("layers.3.attention.qkv") -> HF tensor names without ".weight"
WeightNames = dict[str, tuple[str, ...]]
Tensors = dict[str, torch.Tensor]


def quantize_state(state: Tensors, qtype: int) -> tuple[Tensors, dict[str, int]]:
    """fp32 HF-named weights -> the same names with every 2-D projection/embedding quantised
    (`--weights int8|int4` on a Hugging Face directory)."""
    out: Tensors = {}
    qtypes: dict[str, int] = {}
    for name, tensor in state.items():
        if tensor.dim() == 2 and tensor.shape[1] % 32 == 0 and tensor.is_floating_point():
            out[name], qtypes[name] = quantize(tensor, qtype), qtype
        else:
            out[name] = tensor.float()
    return out, qtypes


class WeightLoader:
    def __init__(
        self, tensors: Tensors, qtypes: dict[str, int] | None, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        self.tensors, self.qtypes = tensors, qtypes
        self.dtype, self.device = dtype, device

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors[name]

    def float(self, name: str) -> torch.Tensor:
        t = self.take(name)
        if self.qtypes is not None and name in self.qtypes:
            raise ValueError(f"tensor {name!r} is quantised where tokenwire needs float values")
        # a copy: the model never shares storage with the caller's state dict
        return t.to(device=self.device, dtype=self.dtype, copy=True)

    def linear(self, stems: tuple[str, ...], target: nn.Linear) -> nn.Module:
        names = [s + ".weight" for s in stems]
        bias = None
        if target.bias is not None:
            bias = torch.cat([self.float(s + ".bias") for s in stems])
        kinds = {self.qtypes.get(n) for n in names} if self.qtypes is not None else {None}
        if len(kinds) == 1 and None not in kinds:  # one block type: concatenate rows as they are
            (qtype,) = kinds
            assert qtype is not None
            return QuantLinear(torch.cat([self.take(n) for n in names]), qtype, target.in_features, bias)
        if kinds == {None}:  # float weights (or no quantised tensors at all), kept float
            layer = nn.Linear(target.in_features, target.out_features, bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(torch.cat([self.float(n) for n in names]), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            return layer
        # mixed block types (K-quant files mix them per tensor): one type for the fused rows
        dense = [dequantize(self.take(n), self.qtypes[n], target.in_features) if n in self.qtypes
                 else self.take(n).float() for n in names]  # fmt: skip
        return QuantLinear.from_float(torch.cat(dense), Q8_0, bias)

    def embedding(self, stem: str, target: nn.Embedding) -> nn.Module:
        name = stem + ".weight"
        if self.qtypes is not None and name in self.qtypes:
            return QuantEmbedding(self.take(name), self.qtypes[name], target.embedding_dim)
        return nn.Embedding.from_pretrained(self.float(name), freeze=True)


def load_weights(
    model: nn.Module,
    names: WeightNames,
    tensors: Tensors,
    qtypes: dict[str, int] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tie: tuple[str, str] | None = None,
) -> None:
    """Fill every module `names` lists; `tie` = (embedding path, lm_head path) shares the
    embedding's table as the lm_head (a tied or head-less checkpoint). Then every tensor of the
    model must be loaded."""
    loader = WeightLoader(tensors, qtypes, dtype, device)
    for path, stems in names.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        target = getattr(parent, attr)
        if isinstance(target, RMSNorm):
            target.weight = nn.Parameter(loader.float(stems[0] + ".weight"), requires_grad=False)
        elif isinstance(target, nn.Linear):
            setattr(parent, attr, loader.linear(stems, target))
        elif isinstance(target, nn.Embedding):
            setattr(parent, attr, loader.embedding(stems[0], target))
        else:
            raise TypeError(f"{path} is a {type(target).__name__}: no weights to load")
    if tie is not None:
        embed, head_path = model.get_submodule(tie[0]), tie[1]
        parent_path, _, attr = head_path.rpartition(".")
        parent = model.get_submodule(parent_path)
        hidden = getattr(parent, attr).in_features
        if isinstance(embed, QuantEmbedding):  # shares the buffer: a tied table is resident once
            head: nn.Module = QuantLinear(embed.packed, embed.qtype, hidden, split=True)
        else:
            assert isinstance(embed, nn.Embedding)
            head = nn.Linear(hidden, embed.num_embeddings, bias=False, device="meta")
            # its own copy, as float models have always had (sharing would save the table's size)
            head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        setattr(parent, attr, head)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the checkpoint left tensors unloaded: {left[:5]}")
    if qtypes is not None:
        move_to_huge_pages(model)  # the decode step streams every block: weight_arena.py says why
