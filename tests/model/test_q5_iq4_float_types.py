"""The weight types Q5_0, Q5_1, IQ4_NL, IQ4_XS (kernels/types_q5_iq4.h) and F16, BF16 (types_float.h),
run from the file's own bytes: dequantisation bit-exact with gguf, matmuls against fp32 ones with
the dequantised weight, a 16-bit float embedding tied as the lm_head, and the fused decode stack
over layers that mix them (F16/BF16 matrices take its fp32 path: they have no int16 format)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tests.model.test_quant import INT16_DECODE_LOGPROB_TOL, MATMUL_RTOL, _decode_runs, _max_logprob_diff
from tests.tiny_models import hf_model
from tokenwire.model.families import build_model, read_config
from tokenwire.model.kernels import compiler_flags, ops
from tokenwire.model.quant import QuantEmbedding, QuantLinear, dequantize, quantize, resident_bytes
from tokenwire.model.weight_types import BF16, F16, IQ4_NL, IQ4_XS, Q5_0, Q5_1, WeightType

TYPES = [Q5_0, Q5_1, IQ4_NL, IQ4_XS, F16, BF16]
BLOCK_TYPES = [Q5_0, Q5_1, IQ4_NL, IQ4_XS]
OURS = (IQ4_NL, IQ4_XS)  # gguf-py has no quantiser for these: quant.quantize's own
AVX2 = "-mavx2" in compiler_flags()


def _ids(wt: WeightType) -> str:
    return wt.name


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)


def _random_bytes(rows: int, cols: int, wt: WeightType, seed: int) -> np.ndarray:
    """Blocks of random bytes: every nibble and high bit, fp16 scales and minimums of any value
    (subnormal, infinite, NaN), any 16-bit float."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, cols // wt.block * wt.block_bytes), dtype=np.uint8)


def _gguf(packed: np.ndarray, wt: WeightType) -> np.ndarray:
    return np.asarray(gguf_dequantize(packed, GGMLQuantizationType(wt.gguf_id)), dtype=np.float32)


def _assert_same_floats(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN equals any NaN: F16C's vcvtph2ps quiets a
    signalling NaN half (numpy keeps its payload)."""
    np.testing.assert_array_equal(got, expected)
    numbers = ~np.isnan(expected)
    assert np.array_equal(got.view(np.uint32)[numbers], expected.view(np.uint32)[numbers])


@pytest.mark.parametrize("wt", TYPES, ids=_ids)
def test_gguf_quantised_blocks_dequantise_bit_exactly(wt: WeightType) -> None:
    """gguf's quantiser where it has one (IQ4_NL, IQ4_XS: ours), through the reference and the
    kernels, whole and by rows."""
    cols = 5 * max(wt.block, 32)
    w = _weights(23, cols, seed=wt.gguf_id)
    w[0, : max(wt.block, 32)] = 0  # an all-zero block
    if wt in OURS:
        packed = quantize(torch.from_numpy(w), wt.gguf_id).numpy()
    else:
        packed = np.ascontiguousarray(gguf_quantize(w, GGMLQuantizationType(wt.gguf_id))).view(np.uint8)
    expected = _gguf(packed, wt)
    np.testing.assert_array_equal(wt.dequantize_reference(packed), expected)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(packed), wt.gguf_id, cols).numpy(), expected)
    rows = torch.tensor([5, 0, 22, 5])
    got = dequantize(torch.from_numpy(packed), wt.gguf_id, cols, rows).numpy()
    np.testing.assert_array_equal(got, expected[rows.numpy()])


@pytest.mark.parametrize("wt", TYPES, ids=_ids)
def test_random_blocks_dequantise_bit_exactly(wt: WeightType) -> None:
    """Every bit pattern, in rows of 1, 3 and 8 blocks (float types: 13 and 100 values, not
    multiples of 8)."""
    for cols in (13, 100, 256) if wt.block == 1 else (wt.block, 3 * wt.block, 8 * wt.block):
        packed = _random_bytes(17, cols, wt, seed=cols)
        with np.errstate(invalid="ignore", over="ignore"):
            expected = _gguf(packed, wt)
            _assert_same_floats(wt.dequantize_reference(packed), expected)
        _assert_same_floats(dequantize(torch.from_numpy(packed), wt.gguf_id, cols).numpy(), expected)


def test_float_types_have_no_integer_dot() -> None:
    """F16 and BF16 rows name no activation format: qmatmul and the fused stack give them fp32."""
    for wt in (F16, BF16):
        name, activation, sizes = ops().weight_type_info(wt.gguf_id)
        assert (name, activation, sizes) == (wt.name, "", [1, 2, 2])
    for wt in BLOCK_TYPES:  # int8, tiled (tests/model/test_tiles.py)
        assert ops().weight_type_info(wt.gguf_id)[1] == (wt.activation if AVX2 else "")
    assert all(wt.activation == "i8_32" and wt.tiled for wt in BLOCK_TYPES)
    with pytest.raises(RuntimeError, match="unsupported quantisation type 16"):
        ops().weight_type_info(16)  # IQ2_XXS


MATMUL_CASES = [(wt, cols) for wt in TYPES if wt.block < 256 for cols in (96, 576)]
MATMUL_CASES += [(IQ4_XS, 256), (IQ4_XS, 768), (F16, 100), (BF16, 100)]


@pytest.mark.parametrize(
    ("wt", "cols"), MATMUL_CASES, ids=lambda c: c.name if isinstance(c, WeightType) else str(c)
)
def test_qmatmul_equals_fp32_matmul_of_the_dequantised_weight(wt: WeightType, cols: int) -> None:
    """qmatmul for M = 1, 3, 7, 32, 300 with fp32 activations (the int16 flag off; F16/BF16
    always) against x @ W.T in fp32, to MATMUL_RTOL (2e-6) relative to max |x @ W.T|: the same
    exact products summed in another order (cols 96: a short group of 3 blocks, a trailing single
    block; 576: two groups of 8 and a pair; 100 for the float types: not a multiple of 8; IQ4_XS:
    1 and 3 super-blocks). The block types' int8 activations (the flag on): test_tiles.py's bound."""
    rows = 41
    packed = quantize(torch.from_numpy(_weights(rows, cols, seed=cols)), wt.gguf_id)
    w = torch.from_numpy(wt.dequantize_reference(packed.numpy()))
    layer = QuantLinear(packed, wt.gguf_id, cols)
    generator = torch.Generator().manual_seed(cols)
    for m in (1, 3, 7, 32, 300):
        x = torch.randn(m, cols, generator=generator) * torch.rand(m, cols, generator=generator) * 4
        x[0, :32] = 0  # an all-zero activation block
        expected = x @ w.T
        for int16 in (False, True):
            got = ops().qmatmul(x, layer.packed, wt.gguf_id, int16)
            assert got.shape == (m, rows)
            if int16 and wt.tiled and AVX2:
                continue  # int8 activations: tests/model/test_tiles.py's bound
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            assert error <= MATMUL_RTOL, (m, int16, error)
        # the module takes the integer path (fp32 for the float types), whatever the rows
        assert torch.equal(layer(x), ops().qmatmul(x, layer.packed, wt.gguf_id, True))


@pytest.mark.parametrize("wt", [F16, BF16], ids=_ids)
def test_float_embedding_tied_as_lm_head(wt: WeightType) -> None:
    """A 16-bit float table looked up by rows (exactly its values) and shared, one buffer, as the
    lm_head, whose decode rows take the fp32 path (no int16 format)."""
    vocab, hidden = 300, 72
    table = torch.from_numpy(_weights(vocab, hidden, seed=5))
    packed = quantize(table, wt.gguf_id)
    assert packed.shape == (vocab, 2 * hidden) and packed.dtype == torch.uint8
    values = torch.from_numpy(wt.dequantize_reference(packed.numpy()))
    rounded = table.to(torch.float16 if wt is F16 else torch.bfloat16).float()
    assert torch.equal(values, rounded)
    embed = QuantEmbedding(packed, wt.gguf_id, hidden)
    ids = torch.tensor([[3, 299, 0], [3, 7, 150]])
    assert torch.equal(embed(ids), values[ids])
    head = QuantLinear(embed.packed, wt.gguf_id, hidden, split=True)
    assert head.packed.data_ptr() == embed.packed.data_ptr()
    x = torch.randn(2, hidden)
    expected = x @ values.T
    for got, want in ((head(x), expected), (head(x[:1]), expected[:1])):
        assert ((got - want).abs().max() / want.abs().max()).item() <= MATMUL_RTOL


def _mixed_model(arch: str, kinds: dict[str, WeightType]) -> torch.nn.Module:
    """A tiny model whose 2-D weights take the type of the first `kinds` key in their name ("qkv":
    q_proj, k_proj and v_proj, which are one projection)."""
    hf = hf_model(arch)
    tensors, qtypes = {}, {}
    for name, t in hf.state_dict().items():
        key = name.replace("q_proj", "qkv").replace("k_proj", "qkv").replace("v_proj", "qkv")
        wt = next((wt for part, wt in kinds.items() if part in key), None)
        if t.dim() == 2 and wt is not None:
            tensors[name], qtypes[name] = quantize(t, wt.gguf_id), wt.gguf_id
        else:
            tensors[name] = t.float()
    return build_model(read_config(hf.config.to_dict()), tensors, qtypes)


@pytest.mark.parametrize(
    "kinds",
    [
        # F16 everywhere: every matvec (and the tied lm_head) on the fp32 path, int16 on or off
        {"qkv": F16, "proj": F16, "embed": F16},
        # down in Q5_1 (int8 tiles), its input quantised block by block as the SwiGLU makes it
        # from a BF16 gate/up; the lm_head IQ4_NL (int8 tiles, its input the head's wide pair)
        {"qkv": Q5_0, "o_proj": IQ4_NL, "gate": BF16, "up": BF16, "down": Q5_1, "embed": IQ4_NL},
        # an F16 down (SwiGLU shared out in 8s, no quantised input) after a Q5_0 gate/up
        {"qkv": BF16, "o_proj": F16, "gate": Q5_0, "up": Q5_0, "down": F16, "embed": Q5_1},
    ],
    ids=["f16", "q5-iq4-bf16-down-q5_1", "bf16-f16-down-f16"],
)
def test_fused_decode_over_the_new_types_equals_eager_layers(smollm2_source, kinds) -> None:
    """The engine's batched decode through the fused stack against the eager layers (fp32 matvecs):
    to 1e-4 with the stack's fp32 path, and with its int16 activations (the default) to 1e-4
    where every matrix is F16 (they take the fp32 path) and to INT16_DECODE_LOGPROB_TOL where
    some are block types."""
    model = _mixed_model("smollm2", kinds)
    assert model.fusion_blocker is None
    assert isinstance(model.embed, QuantEmbedding)
    assert model.lm_head.packed.data_ptr() == model.embed.packed.data_ptr()
    tok = smollm2_source.tokenizer
    eager = _decode_runs(model, tok, fuse=False, int16=True, sequences=2)
    fused_fp32 = _decode_runs(model, tok, fuse=True, int16=False, sequences=2)
    eager_fp32 = _decode_runs(model, tok, fuse=False, int16=False, sequences=2)
    assert _max_logprob_diff(fused_fp32, eager_fp32) <= 1e-4
    fused_int16 = _decode_runs(model, tok, fuse=True, int16=True, sequences=2)
    all_float = all(wt.block == 1 for wt in kinds.values())
    assert _max_logprob_diff(fused_int16, eager) <= (1e-4 if all_float else INT16_DECODE_LOGPROB_TOL)
    if all_float:  # 2 bytes a weight (the norms stay fp32), the tied table once
        hf = hf_model("smollm2")
        dense = build_model(read_config(hf.config.to_dict()), dict(hf.state_dict()))
        assert resident_bytes(model) <= 0.51 * resident_bytes(dense)
