"""The tiled int8 matmul (kernels/tiles.h) of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, Q4_K, Q5_K and
Q6_K: within its
rounding bound of an fp32 matmul with the dequantised weight for any number of rows, each row's
bits independent of the rows beside it, and int8 activations (not fewer bits) on a real-shape
model. Run under TOKENWIRE_KERNELS_ISA=avx2 as well (the AVX2 build's 8-row strips and
vpmaddubsw) as natively (AVX-512: 16-row strips, vpdpbusd)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tokenwire.bench.random_blocks import HALVES, QUANTS, random_blocks
from tokenwire.model import weight_types
from tokenwire.model.kernels import compiler_flags, ops
from tokenwire.model.quant import QuantLinear, quantize
from tokenwire.model.weight_types import WeightType

AVX2 = "-mavx2" in compiler_flags()
TILED = [
    weight_types.Q4_0,
    weight_types.Q4_1,
    weight_types.Q5_0,
    weight_types.Q5_1,
    weight_types.Q8_0,
    weight_types.IQ4_NL,
    weight_types.IQ4_XS,
    weight_types.Q4_K,
    weight_types.Q5_K,
    weight_types.Q6_K,
]
# each type's zero point: the quant byte that makes a weight weigh its block's offset alone
# (Q4: nibble 8; Q5: nibble 0 with its qh bit set = 16; Q8_0: 0; Q6_K: ql 0 with qh bits 2 =
# 32, in _centre; IQ4: none, its table has no 0 and the integer dot takes the whole weight)
ZERO_BYTE = {"Q4_0": 0x88, "Q4_1": 0x88, "Q5_0": 0x00, "Q5_1": 0x00, "Q8_0": 0x00, "Q4_K": 0x88}
pytestmark = pytest.mark.skipif(not AVX2, reason="the tiled kernels need AVX2 (portable builds take fp32)")


def _packed(wt: WeightType, rows: int, cols: int, seed: int) -> np.ndarray:
    if wt.name in HALVES:  # K-quants: valid random blocks (gguf-py has no quantiser for them)
        return random_blocks(rows, cols, wt, seed, magnitude=(1e-4, 1e-1))
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    return quantize(torch.from_numpy(w), wt.gguf_id).numpy()


def _quants_set_to(packed: np.ndarray, wt: WeightType, byte: int) -> np.ndarray:
    """`packed`'s blocks [n, block_bytes] with every quant byte `byte` (a K-quant's whole quant
    range, QUANTS; a 32-weight type's bytes after its fp16 fields) and a Q5_0 / Q5_1 block's 4 qh
    bytes all set (every high bit)."""
    blocks = packed.reshape(-1, wt.block_bytes).copy()
    if wt.name in QUANTS:
        start, end = QUANTS[wt.name]
        blocks[:, start:end] = byte
    elif wt.name == "IQ4_XS":  # d, scales_h, scales_l, then the nibbles
        blocks[:, 8:] = byte
    else:  # the 32-weight types: the quants follow the fp16 fields
        head = wt.block_bytes - (32 if wt.name == "Q8_0" else 16)
        blocks[:, head:] = byte
        if wt.name.startswith("Q5"):  # the 4 qh bytes before the nibbles: every high bit set
            blocks[:, head - 4 : head] = 0xFF
    return blocks


def _centre(packed: np.ndarray, wt: WeightType) -> np.ndarray:
    """What each weight weighs with its quant at the type's zero point: the part of the weight
    the kernels leave to the exact fp32 block sums (Q4_1's m + 8 d, Q4_K's 8 d sc - dmin m; 0
    for the others). |w - centre| = |scale * (q - z)| is what meets the activations' rounding."""
    if wt.name.startswith("IQ4"):
        return np.zeros(wt.dequantize_reference(packed).shape, np.float32)
    blocks = packed.reshape(-1, wt.block_bytes).copy()
    if wt.name == "Q6_K":
        blocks[:, 0:128], blocks[:, 128:192] = 0x00, 0xAA
    elif wt.name == "Q5_K":  # nibble 0 with every qh bit set: 16
        blocks[:, 16:48], blocks[:, 48:176] = 0xFF, 0x00
    else:
        blocks = _quants_set_to(packed, wt, ZERO_BYTE[wt.name])
    return wt.dequantize_reference(blocks.reshape(packed.shape))


def test_the_tiled_types_take_int8_activations() -> None:
    for wt in TILED:
        assert ops().weight_type_info(wt.gguf_id)[1] == "i8_32"


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_tiled_matmul_is_within_the_int8_rounding_bound(wt: WeightType) -> None:
    """qmatmul (int8 activations) against x @ W.T in fp64, W dequantised by gguf's rules, for
    M = 1, 7, 8, 9, 32, 33, 300, 1000 (tiles of 4 / 8 tokens and a short last one), 37 weight
    rows (strips of 8 / 16 and a short last one) and K not a multiple of 8 blocks (11 blocks of
    32; 3 super-blocks). Each activation is off by at most max|its block of 32| / 254 (round to
    nearest, scale max / 127) and meets |w - centre| (the integer part: the centre goes with
    the exact sums), so |error| <= sum over blocks of that product, plus fp32 rounding: 1e-6 of
    sum |x| |w|. And the bound is not slack for fewer bits: over all rows the squared error is
    within [0.5, 2] of its expectation (seen 0.96-0.99) for int8 rounding (uniform in +-step: variance
    step^2 / 3 times sum (w - centre)^2 per block); int7 activations would give ~4."""
    k = 3 * 256 if wt.block == 256 else 11 * 32
    packed = _packed(wt, 37, k, seed=3)
    w = torch.from_numpy(wt.dequantize_reference(packed)).double()
    integer_part = (w - torch.from_numpy(_centre(packed, wt)).double()).abs()  # [37, k]
    layer = QuantLinear(torch.from_numpy(packed), wt.gguf_id, k)
    generator = torch.Generator().manual_seed(7)
    squared, expected_squared = 0.0, 0.0
    for rows in (1, 7, 8, 9, 32, 33, 300, 1000):
        x = torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator) * 4
        x[0, :32] = 0  # an all-zero block
        got, expected = layer(x).double(), x.double() @ w.T
        step = x.abs().view(rows, -1, 32).amax(-1).double() / 254  # [rows, blocks]
        per_block = integer_part.view(37, -1, 32).sum(-1)  # [37, blocks]
        rounding = step @ per_block.T
        bound = rounding + 1e-6 * (x.abs().double() @ w.abs().T) + 1e-30
        error = (got - expected).abs()
        assert (error <= bound).all(), (rows, (error - bound).max().item())
        squared += error.pow(2).sum().item()
        expected_squared += (step.pow(2) / 3 @ integer_part.pow(2).view(37, -1, 32).sum(-1).T).sum().item()
    assert 0.5 < squared / expected_squared < 2.0, squared / expected_squared


# each type's largest quant as a byte pattern over its quant bytes (Q5: nibbles and qh bits all
# set, 31; Q6_K: 63) and, for Q8_0, its most negative (-128: |w| = 128 on AVX2's vpsignb path);
# IQ4's largest is its table's -127 (nibble 0: 241 unsigned on AVX-512, |w| 127 signed on AVX2)
LARGEST_BYTE = {"Q8_0": 0x80, "IQ4_NL": 0x00, "IQ4_XS": 0x00}


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_the_largest_quants_times_the_largest_activations_fit_the_integer_sums(wt: WeightType) -> None:
    """The AVX2 kernels sum several vpmaddubsw results in int16 before widening (Tile<T>::kSum16:
    8 for 4-bit weights, 4 for 5-bit, 2 for Q6_K, 1 for Q8_0's signed ones): every quant at its
    largest against activations all at +-127 (a constant row: each rounds to exactly +-127) is
    the worst case, and it must come out as the fp64 product, to fp32 rounding, with no
    wrap-around (one sum too many would be off by 65536 steps)."""
    k = 2 * 256 if wt.block == 256 else 16 * 32
    packed = _quants_set_to(_packed(wt, 16, k, seed=11), wt, LARGEST_BYTE.get(wt.name, 0xFF)).reshape(16, -1)
    w = torch.from_numpy(wt.dequantize_reference(packed)).double()
    layer = QuantLinear(torch.from_numpy(packed), wt.gguf_id, k)
    x = torch.ones(6, k) * torch.tensor([[1.0], [-1.0], [3.5], [-0.25], [1.0], [-2.0]])
    got, expected = layer(x).double(), x.double() @ w.T
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6 * (x.abs().double() @ w.abs().T).max().item())


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_a_row_has_the_same_bits_alone_in_a_batch_and_in_chunks(wt: WeightType) -> None:
    """Lanes are weight rows and each token has accumulators of its own: a row alone (decode),
    in a batch of 32, at any place of a batch of 33 (a short last tile) and in chunks of 5
    (chunked prefill) gives the same bits; so does one thread against the team (other strips)."""
    k = 4 * 256 if wt.block == 256 else 24 * 32
    layer = QuantLinear(torch.from_numpy(_packed(wt, 100, k, seed=5)), wt.gguf_id, k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(9))
    together = layer(x)
    assert torch.equal(layer(x[:32]), together[:32])
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(33)]), together)
    assert torch.equal(torch.cat([layer(x[i : i + 5]) for i in range(0, 33, 5)]), together)
    assert torch.equal(layer(x.flip(0)).flip(0), together)
    ops().set_team_mode(2)
    try:
        assert torch.equal(layer(x), together)
    finally:
        ops().set_team_mode(1)


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_the_heads_wide_activations_are_finer_and_keep_a_rows_bits(wt: WeightType) -> None:
    """`wide` (the lm_head's input, quant_cpu.cpp's qmatmul_into): each block rounded to
    max|x| / 16256 and carried as two int8 rows, so each activation is off by at most max / 32512
    against int8's max / 254 (the same bound as above with that step), the squared error over
    all rows at most 1/1000 of int8's (the steps' ratio squared is 1/16384: a path that fell back
    to int8 gives ~1), and a row's bits the same alone, in a batch of 33 and in chunks of 5."""
    k = 3 * 256 if wt.block == 256 else 11 * 32
    packed = _packed(wt, 37, k, seed=3)
    w = torch.from_numpy(wt.dequantize_reference(packed)).double()
    integer_part = (w - torch.from_numpy(_centre(packed, wt)).double()).abs()
    layer = QuantLinear(torch.from_numpy(packed), wt.gguf_id, k)

    def wide(x: torch.Tensor) -> torch.Tensor:  # the kernel's, for every tiled type (a head's: below)
        return ops().qmatmul(x, layer.packed, wt.gguf_id, True, True)

    generator = torch.Generator().manual_seed(11)
    wide_squared, int8_squared = 0.0, 0.0
    for rows in (1, 2, 3, 4, 9, 33, 300):
        x = torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator) * 4
        expected = x.double() @ w.T
        got = wide(x).double()
        step = x.abs().view(rows, -1, 32).amax(-1).double() / 32512
        bound = step @ integer_part.view(37, -1, 32).sum(-1).T + 1e-6 * (x.abs().double() @ w.abs().T) + 1e-30
        error = (got - expected).abs()
        assert (error <= bound).all(), (rows, (error - bound).max().item())
        wide_squared += error.pow(2).sum().item()
        int8_squared += (layer(x).double() - expected).pow(2).sum().item()
        together = wide(x)
        assert torch.equal(torch.cat([wide(x[i : i + 1]) for i in range(rows)]), together)
        assert torch.equal(torch.cat([wide(x[i : i + 5]) for i in range(0, rows, 5)]), together)
    assert wide_squared < int8_squared / 1000, wide_squared / int8_squared


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_a_head_takes_wide_activations_where_llama_cpps_are_as_fine_as_int8(wt: WeightType) -> None:
    """QuantLinear(wide=True), the lm_head: the wide activations for the 32-weight types, whose
    llama.cpp dots take int8 a scale per 32 as ours do; int8 for the 256-weight ones (K-quants,
    IQ4_XS), whose llama.cpp dots take Q8_K, a scale per 256 (weight_types.WeightType.wide_head)."""
    k = 2 * 256
    layer = QuantLinear(torch.from_numpy(_packed(wt, 16, k, seed=5)), wt.gguf_id, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    as_head, int8 = layer(x, wide=True), layer(x)
    assert wt.wide_head == (wt.name not in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
    if wt.wide_head:
        assert torch.equal(as_head, ops().qmatmul(x, layer.packed, wt.gguf_id, True, True))
        assert not torch.equal(as_head, int8)
    else:
        assert torch.equal(as_head, int8)


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_decode_rows_have_the_strips_bits(wt: WeightType) -> None:
    """Decode rows (M = 1, 2, 3: each unit multiplied as it is converted, tiles.h's decode_tokens)
    against the strips (M >= 4) on the same rows: the same bits, with K an odd number of units
    that is not a multiple of 8 (the 32-weight types' last group short, its last unit alone in
    a two-unit load) and 45 weight rows (a short last strip of 8 and of 16)."""
    k = 5 * 256 if wt.block == 256 else 13 * 32
    layer = QuantLinear(torch.from_numpy(_packed(wt, 45, k, seed=11)), wt.gguf_id, k)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(13)) * 3
    together = layer(x)  # strips: 12 rows
    for size in (1, 2, 3):
        chunks = [layer(x[i : i + size]) for i in range(0, 12, size)]
        assert torch.equal(torch.cat(chunks), together), size


PROSE = (
    "The licenses for most software and other practical works are designed to take away your freedom to "
    "share and change the works. By contrast, the GNU General Public License is intended to guarantee your "
    "freedom to share and change all versions of a program, to make sure it remains free software for all "
    "its users. When we speak of free software, we are referring to freedom, not price."
)


def _decode_logprobs(engine: Any, tokens: list[int], integer: bool) -> torch.Tensor:
    """[len(tokens) - 1, vocab] log-softmax of each step's logits, one token a step through the
    fused decode stack (its matmuls all in the shipped file's Q4_1, the head Q8_0)."""
    from tokenwire.engine.kv_cache import KVCache
    from tokenwire.model.layers.decoder import PagedDecode

    def run() -> torch.Tensor:
        model = engine.model
        ops().set_int16_activations(integer)
        try:
            blocks = -(-len(tokens) // 16)
            kv = KVCache(model.config, blocks, 16, engine.kv.kv_dtype, model.device)
            table = torch.arange(blocks)[None]
            rows = []
            with torch.inference_mode():
                for p in range(len(tokens) - 1):
                    pos = torch.tensor([p])
                    paged = PagedDecode(kv.k, kv.v, pos, table, kv.k_scale, kv.v_scale)
                    hidden, _ = model(torch.tensor(tokens[p : p + 1]), pos, paged)
                    rows.append(torch.log_softmax(model.logits(hidden)[0].double(), -1))
            return torch.stack(rows)
        finally:
            ops().set_int16_activations(True)

    return engine.call_on_model_thread(run).result()


def test_int8_activations_stay_within_a_kl_bound_of_the_exact_model(smollm2_engine: Any) -> None:
    """The shipped SmolLM2 (Q4_1 layers, Q8_0 head), decoded token by token: its int8
    activations (the head's input wide) against the same weights with fp32 activations (the
    exact dequantised model up to fp32 summation order). Mean KL(exact || int8) per position
    <= 1.0e-2 and the greedy token the same at >= 90% of positions: seen mean 4.5e-3 (max
    3.2e-2), top-1 0.957 (47 positions; SmolLM2's activations have outliers that set their
    blocks' scales); with an int8 head 5.6e-3. KL grows with the rounding error's variance, 4x
    for every bit fewer: int7 activations in the layers would land near 1.8e-2."""
    tokens = smollm2_engine.tokenizer.encode(PROSE)[:48]
    exact = _decode_logprobs(smollm2_engine, tokens, integer=False)
    int8 = _decode_logprobs(smollm2_engine, tokens, integer=True)
    kl = (exact.exp() * (exact - int8)).sum(-1)
    agree = (exact.argmax(-1) == int8.argmax(-1)).double().mean().item()
    assert kl.mean().item() <= 1.0e-2 and agree >= 0.9, (kl.mean().item(), agree)
