"""A LlamaModel whose projections, embedding and lm_head keep quantised weights.

The tensors come from a GGUF conversion's packed file (the file's own blocks) or from fp32
weights quantised at load (`--weights int8|int4` on a Hugging Face directory). q/k/v and
gate/up are fused by concatenating block rows, as the fp32 model concatenates weight rows.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwire.model.config import ModelConfig
from tokenwire.model.llama import LlamaModel, Rotary
from tokenwire.model.quant import Q8_0, QuantEmbedding, QuantLinear, dequantize, quantize
from tokenwire.model.weight_arena import move_to_huge_pages

Tensors = dict[str, torch.Tensor]


def quantize_state(config: ModelConfig, state: Tensors, qtype: int) -> tuple[Tensors, dict[str, int]]:
    """fp32 HF-named weights -> the same names with every 2-D projection/embedding quantised."""
    out: Tensors = {}
    qtypes: dict[str, int] = {}
    for name, tensor in state.items():
        quantizable = tensor.dim() == 2 and tensor.shape[1] % 32 == 0 and tensor.is_floating_point()
        if quantizable:
            out[name], qtypes[name] = quantize(tensor, qtype), qtype
        else:
            out[name] = tensor.float()
    return out, qtypes


def build_quantized_model(
    config: ModelConfig, tensors: Tensors, qtypes: dict[str, int], *, max_positions: int | None = None
) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return tensors[name]

    def param(name: str) -> nn.Parameter:
        return nn.Parameter(take(name).float().contiguous(), requires_grad=False)

    def linear(names: list[str], in_features: int, bias: torch.Tensor | None = None) -> nn.Module:
        kinds = {qtypes.get(n) for n in names}
        if len(kinds) == 1 and None not in kinds:  # one block type: concatenate rows as they are
            (qtype,) = kinds
            assert qtype is not None
            return QuantLinear(torch.cat([take(n) for n in names]), qtype, in_features, bias)
        dense = [
            dequantize(take(n), qtypes[n], in_features) if n in qtypes else take(n).float() for n in names
        ]
        if kinds == {None}:  # float weights (an f16/f32 GGUF asked for gguf): keep them float
            layer = nn.Linear(in_features, sum(d.shape[0] for d in dense), bias=bias is not None)
            with torch.no_grad():
                layer.weight.copy_(torch.cat(dense))
                if bias is not None:
                    layer.bias.copy_(bias)
            return layer.requires_grad_(False)
        # mixed block types (K-quant files mix them per tensor): one type for the fused rows
        return QuantLinear.from_float(torch.cat(dense), Q8_0, bias)

    hidden = config.hidden_size
    embed_name = "model.embed_tokens.weight"
    if embed_name in qtypes:
        model.embed = QuantEmbedding(take(embed_name), qtypes[embed_name], hidden)
    else:
        model.embed = nn.Embedding.from_pretrained(take(embed_name).float(), freeze=True)
    head_name = (
        "lm_head.weight" if "lm_head.weight" in tensors and not config.tie_word_embeddings else embed_name
    )
    if head_name == embed_name and isinstance(model.embed, QuantEmbedding):
        model.lm_head = QuantLinear(
            model.embed.packed, model.embed.qtype, hidden, split=True
        )  # shares the buffer
    else:
        model.lm_head = linear([head_name], hidden)
    model.norm = param("model.norm.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias").float() for n in "qkv"])
        layer.qkv = linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], hidden, bias)
        layer.o_proj = linear([p + "self_attn.o_proj.weight"], config.num_heads * config.head_dim)
        layer.gate_up = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], hidden)
        layer.down = linear([p + "mlp.down_proj.weight"], config.intermediate_size)
        layer.input_norm = param(p + "input_layernorm.weight")
        layer.post_attention_norm = param(p + "post_attention_layernorm.weight")
    model.rotary = Rotary(config, model.max_positions)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise AssertionError(f"quantised model left tensors unloaded: {left[:5]}")
    move_to_huge_pages(model)  # the decode step streams every block: weight_arena.py says why
    return model.eval().requires_grad_(False)
