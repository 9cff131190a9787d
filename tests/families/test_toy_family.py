"""Issue 30: a family defined here, over model/layers/ alone (a Llama with per-head q/k RMSNorm and
a sliding window on every other layer), runs through the engine — paged KV, chunked prefill, a
prefix-cache hit, a fork, the fused decode — equal to a float64 reference of the same math."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenwire.bench.engine_bench import decode_path
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.model import kernels
from tokenwire.model.config import ModelConfig
from tokenwire.model.layers.attention import Attention, AttentionSpec
from tokenwire.model.layers.block import DecoderLayer
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.mlp import GatedMLP
from tokenwire.model.layers.rotary import RopeSpec
from tokenwire.model.quant import Q8_0, QuantLinear

CFG = ModelConfig("Toy", 49152, 64, 128, 4, 4, 2, 16, rms_norm_eps=1e-5, max_position_embeddings=256)
WINDOW = 5


def toy_model(gemma_like: bool = False) -> DecoderModel:
    """`gemma_like`: GELU-tanh MLPs and no RoPE in the last layer (SmolLM3's NoPE layers)."""

    def layer(i: int) -> DecoderLayer:
        spec = AttentionSpec(4, 2, 16, qk_norm=True, window=WINDOW if i % 2 else None)
        rope = RopeSpec.make("none" if gemma_like and i == 3 else "default", 10000.0, 16)
        mlp = GatedMLP(64, 128, "gelu_pytorch_tanh" if gemma_like else "silu")
        return DecoderLayer(i, 64, Attention(i, 64, spec, 1e-5), mlp, eps=1e-5, rope=rope)

    torch.manual_seed(7)
    model = DecoderModel(CFG, [layer(i) for i in range(4)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    for block in model.layers:  # quantised projections, so decode steps take the fused kernel
        for owner, names in ((block.attention, ("qkv", "o_proj")), (block.mlp, ("gate_up", "down"))):
            for name in names:
                setattr(owner, name, QuantLinear.from_float(getattr(owner, name).weight, Q8_0))
    model.finish_build("cpu")
    return model.eval().requires_grad_(False)


def reference_logprobs(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """The same math in float64, written out: [len(ids), vocab] log-softmax."""
    f = lambda t: t.detach().double()  # noqa: E731
    norm = lambda x, w: f(w) * x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()  # noqa: E731
    n, pos = len(ids), torch.arange(len(ids), dtype=torch.float64)
    angles = pos[:, None] / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rope = lambda x: x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin  # noqa: E731
    x = f(model.embed.weight)[ids]
    for block in model.layers:
        att, spec = block.attention, block.attention.spec
        qkv = norm(x, block.attn_norm.weight) @ f(att.qkv.weight).T
        turn = rope if block.rope.kind == "default" else lambda x: x
        q = turn(norm(qkv[:, :64].view(n, 4, 16), att.q_norm.weight))
        k = turn(norm(qkv[:, 64:96].view(n, 2, 16), att.k_norm.weight)).repeat_interleave(2, 1)
        v = qkv[:, 96:].view(n, 2, 16).repeat_interleave(2, 1)
        keep = spec.allowed(torch.arange(n), torch.arange(n))
        scores = torch.einsum("qhd,khd->hqk", q, k) / 4.0
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep, float("-inf")).softmax(-1), v)
        x = x + out.reshape(n, 64) @ f(att.o_proj.weight).T
        gate, up = (norm(x, block.mlp_norm.weight) @ f(block.mlp.gate_up.weight).T).chunk(2, -1)
        if block.mlp.activation == "silu":
            act = gate * torch.sigmoid(gate)
        else:
            act = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
        x = x + (act * up) @ f(block.mlp.down.weight).T
    return (norm(x, model.norm.weight) @ f(model.lm_head.weight).T).log_softmax(-1)


@pytest.mark.parametrize(("fused", "gemma_like"), [(True, False), (False, False), (True, True)])
def test_toy_family_runs_through_the_engine_exactly(smollm2_source, fused: bool, gemma_like: bool) -> None:
    kernels.load_kernels()
    model = toy_model(gemma_like)
    assert model.fusion_blocker is None  # q/k norm and windows are layer kinds the kernel knows
    model.fuse_decode = fused
    kernels.ops().set_int16_activations(False)  # the kernel's fp32 matvecs: the exact path
    engine = Engine(  # an fp32 cache: the exact path (fp16's rounding: tests/engine/test_kv_types.py)
        model, smollm2_source.tokenizer, name="toy", kv_cache_mb=8, max_batch_tokens=8, kv_dtype="fp32"
    )
    greedy = SamplingParams(temperature=0.0)
    opts = GenerateOptions(max_tokens=12, sampling=greedy, ignore_eos=True, logprobs=True)
    try:
        prompt = [(i * 37) % 4000 + 10 for i in range(40)]  # 8 windows long, 5 prefill chunks
        sid = engine.create_session()
        runs = [(prompt, engine.generate(sid, prompt, opts).result()[0])]
        again = engine.generate(None, prompt[:36], opts).result()[0]  # two cached blocks of 16
        assert engine.stats()["prefix_cache_hits"] >= 2
        runs.append((prompt[:36], again))
        fork = engine.fork_session(sid, 44)
        runs.append(([*engine.session_tokens(fork), 99], engine.generate(fork, [99], opts).result()[0]))
        for context, events in runs:
            ids = context + [e.token_id for e in events]
            ref = reference_logprobs(model, ids)[len(context) - 1 : -1]
            for row, e in zip(ref, events, strict=True):
                assert abs(row[e.token_id].item() - e.logprob) <= 1e-4
                assert row.max().item() - row[e.token_id].item() <= 1e-4  # greedy: the top token
    finally:
        engine.shutdown()
        kernels.ops().set_int16_activations(True)


def test_a_layer_the_kernel_does_not_know_decodes_eager_and_says_why() -> None:
    model = toy_model()
    attention = model.layers[2].attention
    attention.spec = dataclasses.replace(attention.spec, softcap=50.0)  # Gemma 2's capped scores
    model.__dict__.pop("fusion_blocker", None)
    assert model.fusion_blocker == "layer 2: attention soft-capping" and not model.can_fuse_decode
    assert decode_path(model) == "eager: layer 2: attention soft-capping"


def test_an_intermediate_size_not_a_multiple_of_8_decodes_eager_and_says_why() -> None:
    """The kernel shares the gated activation out in vectors of 8 (decode_stack.h): such a layer
    is named by the blocker instead of failing at the first fused step."""
    model = toy_model()
    hidden = model.layers[1].mlp.down.out_features
    model.layers[1].mlp = GatedMLP(hidden, 100)  # 100 = 8 * 12 + 4
    model.__dict__.pop("fusion_blocker", None)
    assert model.fusion_blocker == "layer 1: intermediate size 100 (not a multiple of 8)"
    assert not model.can_fuse_decode
