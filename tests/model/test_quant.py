"""Quantised weights: GGUF blocks dequantise bit-exactly, quantised matmuls equal fp32 ones with
the dequantised weight, and a quantised model (fused decode or not) matches its fp32 twin."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tests.random_blocks import offsets
from tests.tiny_models import hf_model
from tokenwire.bench.random_blocks import HALVES, random_blocks
from tokenwire.model import weight_types
from tokenwire.model.families import build_model, experts, read_config
from tokenwire.model.kernels import ops
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import (
    Q4_0,
    Q4_1,
    Q8_0,
    QuantEmbedding,
    QuantLinear,
    dequantize,
    quantize,
    resident_bytes,
)

QTYPES = [Q4_0, Q4_1, Q8_0]
K_TYPES = (weight_types.Q2_K, weight_types.Q3_K, weight_types.Q4_K, weight_types.Q5_K, weight_types.Q6_K)
K_QTYPES = [t.gguf_id for t in K_TYPES]
# |quantised matmul with fp32 activations - fp32 matmul of the dequantised weight| / max|fp32
# result|: both sum the same exact products in fp32, in another order (~1e-7 seen)
MATMUL_RTOL = 2e-6
# quantised matmuls take integer activations per 32-value block (int8 for the tiled types,
# kernels/tiles.h; int16 for the others): logprobs differ from the fp32 activations' by up to
# this, compared while the greedy tokens agree (a tiny random model's near-ties may part them;
# the tiny twins' decode: seen 6.0e-3 with int8)
INT16_DECODE_LOGPROB_TOL = 2e-2
# the same, logits of a tiny twin against its fp32 model (int8: seen 1.0e-2; int16 was 1e-4)
INTEGER_LOGIT_TOL = 3e-2


def _blocks(rows: int, cols: int, qtype: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    packed = np.ascontiguousarray(gguf_quantize(w, GGMLQuantizationType(qtype))).view(np.uint8)
    reference = np.asarray(gguf_dequantize(packed, GGMLQuantizationType(qtype)), dtype=np.float32)
    return torch.from_numpy(packed.reshape(rows, -1).copy()), reference


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_bit_exact_with_gguf(qtype: int) -> None:
    packed, reference = _blocks(67, 96, qtype)
    ours = dequantize(packed, qtype, 96)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), reference)
    rows = torch.tensor([5, 0, 66, 5])  # row lookups (embeddings) too
    np.testing.assert_array_equal(dequantize(packed, qtype, 96, rows).numpy(), reference[rows.numpy()])


def test_real_gguf_blocks_dequantize_bit_exactly(smollm2_source) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_source.source)
    seen = set()
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype in QTYPES and qtype not in seen:
            seen.add(qtype)
            raw = torch.from_numpy(np.array(tensor.data))
            reference = np.asarray(gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            np.testing.assert_array_equal(dequantize(raw, qtype, reference.shape[1]).numpy(), reference)
    assert seen == {Q4_1, Q8_0}  # the shipped file: Q4_1 layers, a Q8_0 embedding


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 300])
def test_fp32_activation_path_equals_fp32_matmul(qtype: int, rows: int, fp32_activations: None) -> None:
    packed, reference = _blocks(130, 576, qtype, seed=rows)
    bias = torch.randn(130)
    layer = QuantLinear(packed, qtype, 576, bias)
    x = torch.randn(rows, 576)
    expected = x @ torch.from_numpy(reference).T + bias
    got = layer(x)
    assert got.shape == (rows, 130)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= MATMUL_RTOL
    # leading dimensions are kept
    assert layer(x.view(1, rows, 576)).shape == (1, rows, 130)


@pytest.mark.parametrize("qtype", K_QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32, 300])
def test_k_quant_matmul_equals_fp32_matmul(qtype: int, rows: int) -> None:
    """K-quant super-blocks (3 per row) through qmatmul, fp32 and int16 activations, against
    x @ W.T with W dequantised by gguf's rules. fp32 activations (int16 off): the same exact
    products summed in fp32 in another order, within 2e-6 of sum |x w| (seen: 3e-7). int16 rows
    (any M): the documented rounding of each activation (max|its block| / 65534, blocks of 32 or,
    for Q2_K, Q3_K, Q6_K, of 16 inside them) times the integer part of the weights (what is left
    with the offset -dmin*m, Q3_K's -4 d*scale or Q6_K's -32 d*scale taken out: those meet the
    exact fp32 block sums), plus the fp32 rounding of the terms, 1e-6 of sum |x| (|w| + |offset|)
    (seen: 2e-8). Q4_K and Q6_K run tiled (int8 activations) where the build has AVX2: their
    bound is tests/model/test_tiles.py's."""
    wt = weight_types.weight_type(qtype)
    k = 3 * wt.block
    packed = random_blocks(67, k, wt, seed=rows)
    w = torch.from_numpy(wt.dequantize_reference(packed))
    offset = torch.from_numpy(offsets(packed, wt))
    split = wt.split_rows(torch.from_numpy(packed))
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator) * 4
    x[0, :32] = 0  # an all-zero activation block
    expected = x @ w.T
    fp32 = ops().qmatmul(x, split, qtype, False)
    assert ((fp32 - expected).abs() <= 2e-6 * (x.abs() @ w.abs().T)).all()
    if wt.tiled:
        return
    got = ops().qmatmul(x, split, qtype, True)
    block_max = x.abs().view(rows, -1, 32).amax(-1)
    integer_part = (w - offset).abs().view(67, -1, 32).sum(-1)
    bound = block_max @ integer_part.T / 65534 + 1e-6 * (x.abs() @ (w.abs() + offset.abs()).T)
    assert ((got - expected).abs() <= bound).all(), (got - expected).abs().max().item()


def test_quantized_layers_reject_what_they_cannot_run() -> None:
    packed, _ = _blocks(4, 64, Q8_0)
    with pytest.raises(ValueError, match="not uint8"):
        QuantLinear(packed, Q8_0, 96)  # wrong feature count for these bytes
    with pytest.raises(ValueError, match="unsupported quantisation type"):
        QuantLinear(packed, 16, 64)  # IQ2_XXS
    with pytest.raises(TypeError, match="float32 activations"):
        QuantLinear(packed, Q8_0, 64)(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of the 32-weight block"):
        quantize(torch.randn(4, 48), Q8_0)


def test_quantize_round_trips_through_gguf_reference() -> None:
    w = torch.randn(8, 64)
    packed = quantize(w, Q4_1)
    reference = gguf_dequantize(packed.numpy(), GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(dequantize(packed, Q4_1, 64).numpy(), reference)
    assert (dequantize(packed, Q4_1, 64) - w).abs().max() < 0.5  # 4 bits of a N(0,1) row


def _twins(qtype: int, arch: str = "smollm2") -> tuple[torch.nn.Module, torch.nn.Module]:
    """A quantised tiny model and the fp32 model built from its dequantised weights."""
    hf = hf_model(arch)
    config = read_config(hf.config.to_dict())
    # experts one tensor each (transformers >= 5 stacks them), so each is quantised like the rest
    state = dict(experts.renamed(dict(hf.state_dict()), experts.count(config)))
    tensors, qtypes = quantize_state(state, qtype)
    quantised = build_model(config, tensors, qtypes)
    dense_state = {
        name: dequantize(t, qtypes[name], t.shape[1] // {Q4_0: 18, Q4_1: 20, Q8_0: 34}[qtype] * 32)
        if name in qtypes
        else t
        for name, t in tensors.items()
    }
    return quantised, build_model(config, dense_state)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_quantized_model_matches_fp32_twin(qtype: int) -> None:
    quantised, dense = _twins(qtype)
    assert isinstance(quantised.embed, QuantEmbedding) and quantised.can_fuse_decode
    assert quantised.lm_head.packed.data_ptr() == quantised.embed.packed.data_ptr()  # tied: one table
    assert resident_bytes(quantised) < resident_bytes(dense) / 3
    ids = torch.randint(0, 49152, (40,))
    with torch.inference_mode():
        h_q, _ = quantised(ids, torch.arange(40), DenseCausalAttention(1, 40))
        h_d, _ = dense(ids, torch.arange(40), DenseCausalAttention(1, 40))
        logits_q, logits_d = quantised.logits(h_q), dense.logits(h_d)
    assert (logits_q - logits_d).abs().max().item() <= INTEGER_LOGIT_TOL


def _greedy(engine, prompt: list[int], n: int) -> list[int]:
    from tokenwire.engine.request import GenerateOptions, SamplingParams

    opts = GenerateOptions(max_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    events, _ = engine.generate(None, prompt, opts).result()
    return [e.token_id for e in events]


def _decode_runs(model, tokenizer, fuse: bool, int16: bool, sequences: int) -> list[list[tuple[int, float]]]:
    from tokenwire.engine.engine import Engine
    from tokenwire.engine.request import GenerateOptions, SamplingParams
    from tokenwire.model.kernels import ops

    prompts = [[1, 2, 3, 4, 5] * k + [7] for k in range(1, 4 * sequences, 4)]
    model.fuse_decode = fuse
    ops().set_int16_activations(int16)
    # an fp32 cache: these runs hold the matmuls' paths to each other, and an fp16 cache would
    # round the paths' keys (1e-6 apart) to fp16 values an ulp (1e-3) apart now and then; one
    # step a token (no speculation), as the team tests count them
    engine = Engine(model, tokenizer, name="tiny", kv_cache_mb=16, kv_dtype="fp32", speculate="off")
    try:
        opts = GenerateOptions(
            max_tokens=20, sampling=SamplingParams(temperature=0.0), ignore_eos=True, logprobs=True
        )
        # decoded as one batch, every time: the model thread is held between steps until every
        # prompt is queued (else the first may start alone, whenever the thread is quicker, and
        # a step of one row is a different sum than a step of two: runs differed at 1e-6)
        held, go = threading.Event(), threading.Event()
        engine.call_on_model_thread(lambda: (held.set(), go.wait(30)))
        held.wait(30)
        handles = [engine.generate(None, p, opts) for p in prompts]
        go.set()
        return [[(e.token_id, e.logprob) for e in h.result()[0]] for h in handles]
    finally:
        engine.shutdown()
        ops().set_int16_activations(True)


def _logprob_diff_while_agreeing(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> float:
    """The largest |logprob difference| of each sequence's tokens up to where the two greedy
    runs part (if they do), that position included: there each run's own greedy token's
    logprob, the top of two near-tied distributions, which differ by no more than the rest."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for (s, p), (t, q) in zip(x, y, strict=True):
            worst = max(worst, abs(p - q))
            if s != t:
                break
    return worst


def _max_logprob_diff(a: list[list[tuple[int, float]]], b: list[list[tuple[int, float]]]) -> float:
    for x, y in zip(a, b, strict=True):
        assert [t for t, _ in x] == [t for t, _ in y]
    return max(abs(p - q) for x, y in zip(a, b, strict=True) for (_, p), (_, q) in zip(x, y, strict=True))


@pytest.mark.parametrize(
    ("arch", "qtype", "sequences"),
    [
        ("smollm2", Q8_0, 3),
        ("smollm2", Q4_1, 1),
        ("qwen2", Q4_0, 2),
        ("smollm2", Q4_1, 5),
        # the kernel's per-layer parts: Qwen3's q/k norm and sliding window, SmolLM3's NoPE layer
        ("qwen3", Q8_0, 2),
        ("smollm3", Q4_0, 2),
        # the attention's other head sizes (AVX-512: 8 and 3 vectors a head)
        ("llama_d128", Q4_0, 2),
        ("llama_d48", Q8_0, 2),
        # mixtures of experts: Mixtral's renormalised top 2 of 4, Qwen3-MoE's with a dense layer
        # among them, OLMoE's raw weights and q/k norms over whole projections
        ("mixtral", Q8_0, 2),
        ("qwen3_moe", Q4_1, 2),
        ("olmoe", Q8_0, 2),
        # Gemma 3's sandwich norms, GELU and local layers (window 8) in the cache's window pool,
        # past the window; its global layers in the full-context pool
        ("gemma3", Q8_0, 2),
        ("gemma3_gguf", Q4_1, 2),
    ],
)
def test_fused_decode_equals_eager_layers_in_the_engine(
    smollm2_source, arch: str, qtype: int, sequences: int
) -> None:
    """Prefill and batched decode through the fused stack (paged KV, sequences of different
    lengths) give the eager layers' tokens and logprobs to 1e-4 with fp32 activations; with the
    integer activations both paths stay within the documented tolerance of that exact run.
    SmolLM2's tiny twin has 3 blocks per row (a short last group), Qwen2's a qkv bias."""
    quantised, _ = _twins(qtype, arch)
    assert quantised.fusion_blocker is None  # every layer is of a kind the kernel runs
    tok = smollm2_source.tokenizer
    exact = _decode_runs(quantised, tok, fuse=False, int16=False, sequences=sequences)
    fused = _decode_runs(quantised, tok, fuse=True, int16=False, sequences=sequences)
    assert _max_logprob_diff(fused, exact) <= 1e-4
    # integer activations: int8 rounding turns the paths' fp32 order differences (norms,
    # attention) into whole rounding steps now and then, so each is held to the exact run
    for fuse in (False, True):
        runs = _decode_runs(quantised, tok, fuse=fuse, int16=True, sequences=sequences)
        assert _logprob_diff_while_agreeing(runs, exact) <= INT16_DECODE_LOGPROB_TOL


@pytest.mark.parametrize("wt", [t for t in weight_types.WEIGHT_TYPES if t.activation], ids=lambda t: t.name)
def test_each_row_computes_the_same_alone_or_in_a_batch(wt: weight_types.WeightType) -> None:
    """Every type's int16 matmul sums each (weight row, activation row) in one order whatever the
    number of rows: a row alone, in a batch of 37 and at any place in it gives the same bits."""
    from tokenwire.model.kernels import ops

    k = 256 * 9  # whole super-blocks, and a short last group of 32-weight blocks (72 = 8*9)
    if wt.name in HALVES:  # K-quants: valid random blocks (no quantiser in gguf-py)
        packed = torch.from_numpy(random_blocks(211, k, wt, magnitude=(1e-4, 1e-2)))
    else:
        packed = quantize(torch.randn(211, k, generator=torch.Generator().manual_seed(1)), wt.gguf_id)
    layer = QuantLinear(packed, wt.gguf_id, k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(37)])
    reversed_rows = layer(x.flip(0)).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reversed_rows)
    ops().set_team_mode(2)  # one thread: other row ranges per task, the same bits
    try:
        assert torch.equal(layer(x), together)
    finally:
        ops().set_team_mode(1)


def test_projections_of_mixed_block_types_fuse_each_part_in_its_type(smollm2_source) -> None:
    """q/k in Q8_0 beside v in Q4_0, gate in Q4_1 beside up in Q8_0 (K-quant files mix types
    so): each projection is stacked from its parts, fused decode runs each part in its own type
    and equals the eager layers (fp32 matvecs both) and the fp32 model of the same values."""
    from tokenwire.model.quant import StackedQuantLinear

    hf = hf_model("smollm2")
    config = read_config(hf.config.to_dict())
    mix = {"q_proj": Q8_0, "k_proj": Q8_0, "v_proj": Q4_0, "o_proj": Q4_1, "gate_proj": Q4_1,
           "up_proj": Q8_0, "down_proj": Q4_0, "embed_tokens": Q8_0}  # fmt: skip
    tensors, qtypes, dense = {}, {}, {}
    for name, t in hf.state_dict().items():
        kind = next((q for key, q in mix.items() if f".{key}." in name), None)
        if kind is None or t.dim() != 2:
            tensors[name] = dense[name] = t
            continue
        tensors[name], qtypes[name] = quantize(t, kind), kind
        dense[name] = dequantize(tensors[name], kind, t.shape[1])
    quantised, reference = build_model(config, tensors, qtypes), build_model(config, dense)
    layer = quantised.layers[0]
    assert isinstance(layer.attention.qkv, StackedQuantLinear)
    assert isinstance(layer.mlp.gate_up, StackedQuantLinear)
    assert quantised.fusion_blocker is None
    tok = smollm2_source.tokenizer
    eager = _decode_runs(quantised, tok, fuse=False, int16=False, sequences=2)
    fused = _decode_runs(quantised, tok, fuse=True, int16=False, sequences=2)
    assert _max_logprob_diff(fused, eager) <= 1e-4
    exact = _decode_runs(reference, tok, fuse=False, int16=False, sequences=2)
    assert _max_logprob_diff(eager, exact) <= 1e-4
    fused_int16 = _decode_runs(quantised, tok, fuse=True, int16=True, sequences=2)
    assert _max_logprob_diff(fused_int16, eager) <= INT16_DECODE_LOGPROB_TOL


def _k_quant_model() -> torch.nn.Module:
    """A two-layer Llama (hidden 256, 4 heads of 64, MLP 512) whose projections are random K-quant
    blocks, the five types mixed over roles and layers: the two down projections take different
    int16 formats (Q6_K's and Q2_K's)."""
    from tokenwire.model.config import ModelConfig
    from tokenwire.model.layers.attention import Attention, AttentionSpec
    from tokenwire.model.layers.block import DecoderLayer
    from tokenwire.model.layers.decoder import DecoderModel
    from tokenwire.model.layers.mlp import GatedMLP
    from tokenwire.model.layers.rotary import RopeSpec

    config = ModelConfig("Toy", 49152, 256, 512, 2, 4, 2, 64, max_position_embeddings=256)
    roles = [  # qkv, o, gate_up, down
        (weight_types.Q4_K, weight_types.Q5_K, weight_types.Q2_K, weight_types.Q6_K),
        (weight_types.Q3_K, weight_types.Q4_K, weight_types.Q6_K, weight_types.Q2_K),
    ]

    def layer(i: int) -> DecoderLayer:
        attention = Attention(i, 256, AttentionSpec(4, 2, 64), 1e-5)
        rope = RopeSpec.make("default", 10000.0, 64)
        return DecoderLayer(i, 256, attention, GatedMLP(256, 512, "silu"), eps=1e-5, rope=rope)

    torch.manual_seed(11)
    model = DecoderModel(config, [layer(i) for i in range(2)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    for block, types in zip(model.layers, roles, strict=True):
        projections = (
            (block.attention, "qkv"),
            (block.attention, "o_proj"),
            (block.mlp, "gate_up"),
            (block.mlp, "down"),
        )
        for (owner, name), wt in zip(projections, types, strict=True):
            n, k = getattr(owner, name).weight.shape
            packed = random_blocks(n, k, wt, seed=n + k, magnitude=(1e-5, 1e-4))
            setattr(owner, name, QuantLinear(torch.from_numpy(packed), wt.gguf_id, k))
    model.finish_build("cpu")
    return model.eval().requires_grad_(False)


def test_fused_decode_runs_k_quant_weights(smollm2_source) -> None:
    """The fused stack with K-quant projections (their rows' functions and int16 formats) gives
    the eager layers' tokens and logprobs to 1e-4 with the same matmuls (int16 activations both,
    or fp32 both), and the fp32-activation run's to the int16 tolerance."""
    model = _k_quant_model()
    assert model.fusion_blocker is None
    tok = smollm2_source.tokenizer
    runs = {}
    for int16 in (False, True):
        eager = _decode_runs(model, tok, fuse=False, int16=int16, sequences=2)
        runs[int16] = _decode_runs(model, tok, fuse=True, int16=int16, sequences=2)
        assert _max_logprob_diff(runs[int16], eager) <= 1e-4
    assert _max_logprob_diff(runs[True], runs[False]) <= INT16_DECODE_LOGPROB_TOL


def test_row_stats_match_torch_reductions() -> None:
    """The engine's per-row max / first argmax / logsumexp kernel against torch: ties take the
    first index, a NaN is the maximum, an all -inf row has -inf logsumexp, rows whose logsumexp
    is not wanted get NaN there, and a vocabulary not a multiple of 8 is read to its end."""
    from tokenwire.model.kernels import ops

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 49157, generator=generator) * 4
    logits[1, 49156] = 100.0  # the max in the scalar tail
    logits[2, [5, 900]] = 50.0  # a tie: the first index
    logits[3, 17] = float("nan")
    logits[4] = float("-inf")
    want = torch.tensor([True, True, True, True, True, False])
    maxima, argmax, lse = ops().row_stats(logits, want)
    expected_max = logits.max(dim=-1).values
    assert torch.equal(maxima[[0, 1, 2, 4, 5]], expected_max[[0, 1, 2, 4, 5]]) and maxima[3].isnan()
    assert argmax.tolist() == [int(logits[0].argmax()), 49156, 5, 17, 0, int(logits[5].argmax())]
    torch.testing.assert_close(lse[:3], torch.logsumexp(logits[:3], dim=-1), rtol=1e-6, atol=1e-5)
    assert lse[3].isnan() and lse[4] == float("-inf") and lse[5].isnan()


def test_fused_decode_readouts_equal_the_eager_layers(smollm2_source) -> None:
    """Readouts capture layer outputs mid-stack (the fused kernel runs in segments) and after the
    final norm (done inside the kernel): the same values as the eager layers (fp32 matvecs)."""
    from tokenwire.engine.concepts import ConceptSet
    from tokenwire.engine.engine import Engine
    from tokenwire.engine.request import GenerateOptions, SamplingParams
    from tokenwire.model.kernels import ops

    quantised, _ = _twins(Q8_0)
    concepts = ConceptSet(
        names=["a", "b"],
        layers=[0, 1, 2],
        vectors=torch.randn(3, 2, 96, generator=torch.Generator().manual_seed(3)),
    )
    readouts = {}
    ops().set_int16_activations(False)
    try:
        for fuse in (False, True):
            quantised.fuse_decode = fuse
            engine = Engine(
                quantised, smollm2_source.tokenizer, name="tiny", kv_cache_mb=8, concepts=concepts
            )
            try:
                opts = GenerateOptions(
                    max_tokens=4,
                    sampling=SamplingParams(temperature=0.0),
                    ignore_eos=True,
                    readout_ranges=[(6, 11)],
                )
                events, _ = engine.generate(None, [1, 2, 3, 4, 5, 6, 7], opts).result()
                readouts[fuse] = {e.position: e.readout for e in events if e.readout is not None}
            finally:
                engine.shutdown()
    finally:
        ops().set_int16_activations(True)
        quantised.fuse_decode = True
    assert sorted(readouts[True]) == list(range(6, 11))  # decode positions 7..10 among them
    for position, value in readouts[False].items():
        assert value.shape == (3, 2)
        torch.testing.assert_close(readouts[True][position], value, rtol=1e-4, atol=1e-4)


def test_packed_weights_live_in_huge_page_mappings(monkeypatch) -> None:
    """Every packed buffer lies in the arena's madvise'd mappings (each chunk 2 MiB-aligned), the
    tied embedding and lm_head still share one table, and the model computes the same without
    huge pages."""
    from tokenwire.model import weight_arena

    available = weight_arena.huge_pages_available()
    quantised, _ = _twins(Q4_1)
    packed = [m.packed for m in quantised.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert quantised.lm_head.packed.data_ptr() == quantised.embed.packed.data_ptr()
    monkeypatch.setattr(weight_arena, "huge_pages_available", lambda: False)
    plain, _ = _twins(Q4_1)  # the same weights in mappings not advised
    assert not plain._weight_arena.huge
    ids = torch.randint(0, 49152, (12,))
    with torch.inference_mode():
        a, _ = quantised(ids, torch.arange(12), DenseCausalAttention(1, 12))
        b, _ = plain(ids, torch.arange(12), DenseCausalAttention(1, 12))
    assert torch.equal(a, b)
    if not available:  # the fallback is checked above; the mapping itself needs the kernel's THP
        pytest.skip("transparent huge pages are off on this machine")
    arena = quantised._weight_arena
    assert arena.huge
    mapped = [torch.frombuffer(m, dtype=torch.uint8) for m in arena.mappings]
    spans = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in mapped]
    assert all(any(lo <= t.data_ptr() and t.data_ptr() + t.numel() <= hi for lo, hi in spans) for t in packed)
    assert min(t.data_ptr() for t in packed) % weight_arena.HUGE_PAGE == 0
