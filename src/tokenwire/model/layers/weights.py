"""A family's checkpoint into its assembled stack: one name table, float or quantised weights.

A family lists, for every module of its stack that holds weights, the Hugging Face tensor names
that fill it (`WeightNames`); several names are concatenated by rows (q/k/v into one projection,
gate/up into one). The same table loads fp32/bf16 checkpoints and the quantised tensors of a GGUF
conversion or of `--weights int8|int4` (`qtypes`: the block type of each quantised tensor).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import groupby

import torch
from torch import nn

from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.quant import QuantEmbedding, QuantLinear, StackedQuantLinear, lay_out, quantize
from tokenwire.model.weight_arena import WeightArena
from tokenwire.model.weight_types import weight_type

# module path in the stack ("layers.3.attention.qkv") -> HF tensor names without ".weight"
WeightNames = dict[str, tuple[str, ...]]
# HF name -> tensor: a dict, or a GGUF read tensor by tensor as asked (model/gguf_weights.py)
Tensors = Mapping[str, torch.Tensor]


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip
_init_lock = threading.Lock()


@contextmanager
def meta_init_skipped() -> Iterator[None]:
    """Modules made on the meta device skip their random init: their weights are loaded after.
    A meta tensor's normal_ / uniform_ runs torch's Python reference, whose first call imports
    torch._dynamo (about 800 modules): SmolLM2's start peaked 73 MiB higher for it. Real tensors
    are initialised as ever; one build at a time patches torch.nn.init."""
    with _init_lock:
        saved = {name: getattr(nn.init, name) for name in _INITS}

        def skipping(original):  # type: ignore[no-untyped-def]
            def init(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
                return tensor if tensor.is_meta else original(tensor, *args, **kwargs)

            return init

        for name, original in saved.items():
            setattr(nn.init, name, skipping(original))
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(nn.init, name, original)


def quantize_state(state: Tensors, qtype: int) -> tuple[Tensors, dict[str, int]]:
    """fp32 HF-named weights -> the same names with every 2-D projection/embedding quantised
    (`--weights int8|int4` on a Hugging Face directory); a mixture of experts' router stays
    float, as llama.cpp keeps it: its logits choose the experts."""
    out: dict[str, torch.Tensor] = {}
    qtypes: dict[str, int] = {}
    for name, tensor in state.items():
        router = name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))
        if tensor.dim() == 2 and tensor.shape[1] % 32 == 0 and tensor.is_floating_point() and not router:
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
        self.arena = WeightArena()  # quantised weights, each written once into its place

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
        qtypes = self.qtypes or {}
        # runs of names in one block type become one weight (q/k/v rows concatenated as they are)
        runs = [(qtype, list(run)) for qtype, run in groupby(names, key=qtypes.get)]
        if runs[0][0] is None and len(runs) == 1:  # float weights, kept float
            layer = nn.Linear(target.in_features, target.out_features, bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(torch.cat([self.float(n) for n in names]), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            return layer
        if any(qtype is None for qtype, _ in runs):
            floats = [n for n in names if n not in qtypes]
            raise ValueError(f"tensors {floats} are float beside quantised ones in one projection")
        k = target.in_features
        blocks = [(self.packed(run, q, k), q) for q, run in runs]
        if len(blocks) == 1:
            return QuantLinear(*blocks[0], k, bias, split=True)
        return StackedQuantLinear([QuantLinear(packed, q, k, split=True) for packed, q in blocks], bias)

    def packed(self, names: list[str], qtype: int, in_features: int) -> torch.Tensor:
        """The rows of `names` (one block type), split for the kernels, in one arena tensor:
        each source tensor is read and written into its place once."""
        kind = weight_type(qtype)
        row_bytes = kind.packed_shape(1, in_features)[1]
        sources = [self.take(n) for n in names]  # a GGUF's are read from the file here
        out = self.arena.take((sum(len(t) for t in sources), row_bytes))
        at = 0
        for name, source in zip(names, sources, strict=True):
            if tuple(source.shape) != (len(source), row_bytes) or source.dtype != torch.uint8:
                shape = tuple(source.shape)
                raise ValueError(f"tensor {name!r} is {shape}, not {kind.name} rows of {in_features}")
            kind.split_rows_into(source, out[at : at + len(source)])
            at += len(source)
        lay_out(out, qtype, in_features)
        return out

    def embedding(self, stem: str, target: nn.Embedding) -> nn.Module:
        name = stem + ".weight"
        if self.qtypes is not None and name in self.qtypes:
            packed = self.packed([name], self.qtypes[name], target.embedding_dim)
            return QuantEmbedding(packed, self.qtypes[name], target.embedding_dim, split=True)
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
    complete: bool = True,
) -> None:
    """Fill every module `names` lists; `tie` = (embedding path, lm_head path) shares the
    embedding's table as the lm_head (a tied or head-less checkpoint). Then every tensor of the
    model must be loaded (unless not `complete`: some of it, the rest loaded later)."""
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
    if left and complete:
        raise ValueError(f"the checkpoint left tensors unloaded: {left[:5]}")
    if loader.arena.mappings:  # the quantised weights' memory (weight_arena.py): kept alive
        model._weight_arena = loader.arena  # type: ignore[assignment]
