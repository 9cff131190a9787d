"""model/layers/ blocks the shipped families do not use yet, against plain references: the
mixture of experts (each token through its own experts, one at a time), LongRoPE's frequencies
and attention factor (transformers' own), Gemma's (1 + w) norm and a soft-capped attention."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenwire.model.layers.attention import AttentionSpec, attend
from tokenwire.model.layers.mlp import GatedMLP, MixtureOfExperts
from tokenwire.model.layers.norm import RMSNorm
from tokenwire.model.layers.rotary import RopeSpec, Rotary, inv_freq


def _moe(normalize: bool) -> MixtureOfExperts:
    torch.manual_seed(3)
    moe = MixtureOfExperts(32, 48, num_experts=6, top_k=2, normalize=normalize)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe.eval()


@pytest.mark.parametrize("normalize", [True, False])
def test_experts_run_for_their_tokens_and_a_batch_equals_each_token_alone(normalize: bool) -> None:
    moe = _moe(normalize)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        batch = moe(x)
        probs = moe.router(x).softmax(-1)
        for i in range(len(x)):
            alone = moe(x[i : i + 1])[0]
            w, chosen = probs[i].topk(2)
            w = w / w.sum() if normalize else w
            reference = sum(w[j] * moe.experts[int(e)](x[i : i + 1])[0] for j, e in enumerate(chosen))
            assert torch.allclose(batch[i], alone, atol=1e-6)
            assert torch.allclose(batch[i], reference, atol=1e-6)
    calls: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, args, _o, e=e: calls.append((e, len(args[0]))))
    with torch.no_grad():
        moe(x)
    routed = probs.topk(2).indices
    assert sorted(e for e, _ in calls) == sorted(set(routed.flatten().tolist()))  # once each
    assert all(n == int((routed == e).sum()) for e, n in calls)  # just its tokens


@pytest.mark.parametrize("context", [2048, 8192])
def test_longrope_matches_transformers(context: int) -> None:
    short, long = [1.0 + 0.1 * i for i in range(8)], [2.0 + 0.5 * i for i in range(8)]
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 4096,
    }
    cfg = Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_parameters=scaling | {"rope_theta": 10000.0},
    )  # fmt: skip
    cfg.rope_theta = 10000.0  # the attribute the init function reads (transformers 5 keeps it nested)
    theirs, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=context)
    ours, our_factor = inv_freq(RopeSpec.make("longrope", cfg.rope_theta, 16, scaling), context)
    assert torch.allclose(ours, theirs.float(), rtol=1e-6)
    expected = 1.0 if context <= 4096 else math.sqrt(1 + math.log(context / 4096) / math.log(4096))
    assert our_factor == pytest.approx(expected) and factor == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096))
    )
    table = Rotary(RopeSpec.make("longrope", cfg.rope_theta, 16, scaling), context)
    cos, _ = table.half_tables(torch.tensor([0]))
    assert cos.max().item() == pytest.approx(our_factor)  # cos(0) x the attention factor


def test_offset_norm_and_softcap() -> None:
    x, w = torch.randn(3, 8), torch.randn(8)
    norm = RMSNorm(8, 1e-6, offset=1.0)
    norm.weight.data.copy_(w)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(norm(x), expected, atol=1e-6)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    spec = AttentionSpec(2, 2, 4, softcap=2.0, window=2)
    scores = torch.tanh(q @ k.transpose(-1, -2) / 2 / 2.0) * 2.0
    pos = torch.arange(5)
    scores = scores.masked_fill(
        ~((pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 2)), float("-inf")
    )
    assert torch.allclose(attend(q, k, v, spec.allowed(pos, pos), spec), scores.softmax(-1) @ v, atol=1e-6)


def test_gelu_tanh_mlp() -> None:
    mlp = GatedMLP(8, 16, "gelu_pytorch_tanh")
    x = torch.randn(2, 8)
    gate, up = (x @ mlp.gate_up.weight.T).chunk(2, -1)
    expected = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ mlp.down.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-6)


def test_a_rotary_holds_no_table_per_position() -> None:
    """cos/sin come per step (as llama.cpp computes them): a rotary's memory does not grow with the
    context. Tables for every position held Gemma 3 1B's two rotaries at 128 MiB (32k positions,
    heads of 256), past the start-up memory target; the values are the same either way."""
    spec = RopeSpec.make("linear", 1000000.0, 256, {"factor": 8.0})
    short, long = Rotary(spec, 16), Rotary(spec, 32768)
    assert sum(b.numel() for b in long.buffers()) == sum(b.numel() for b in short.buffers()) == 128
    positions = torch.tensor([0, 5, 32767])
    cos, sin = long.tables(positions, torch.float32, None)
    angles = torch.outer(torch.arange(32768, dtype=torch.float32), long.freq)[positions]
    assert torch.equal(cos[:, 0], torch.cat([angles.cos(), angles.cos()], -1))
    assert torch.equal(sin[:, 0], torch.cat([-angles.sin(), angles.sin()], -1))
