"""The laid-out weight form (kernels/tiles.h's LaidSrc, `quant.lay_out`): a tiled type's matrix of
whole row groups is kept dword-interleaved by group (Q6_K's blocks also reordered), and every
reader gives what the split rows give, bit for bit: decode rows (converted into registers), the
strips, the lm_head's wide activations, fp32 activations, dequantisation and embedding lookups,
and thread ranges that start inside a group. Run under TOKENWIRE_KERNELS_ISA=avx2 too (groups of
8 rows there, 16 on AVX-512)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.test_tiles import AVX2, TILED, _packed
from tokenwire.model.kernels import ops
from tokenwire.model.quant import QuantEmbedding, QuantLinear, lay_out
from tokenwire.model.weight_types import WeightType

pytestmark = pytest.mark.skipif(not AVX2, reason="the laid-out form is the tiled kernels' (AVX2 and up)")


def _features(wt: WeightType, odd: bool) -> int:
    """K with an odd number of super-blocks (Q6_K's last block alone, its d in the tail) or an
    even number of 32-weight blocks that is not a multiple of 8 (a short last group)."""
    if wt.block == 256:
        return (5 if odd else 4) * 256
    return 14 * 32


def _pair(wt: WeightType, rows: int, k: int, seed: int) -> tuple[QuantLinear, QuantLinear]:
    """(the first `rows` rows, laid out; the same rows plus one, which cannot be)"""
    packed = torch.from_numpy(_packed(wt, rows + 1, k, seed))
    laid, split = QuantLinear(packed[:rows].clone(), wt.gguf_id, k), QuantLinear(packed, wt.gguf_id, k)
    assert not torch.equal(laid.packed, split.packed[:rows]), "the matrix was not laid out"
    return laid, split


# the 32-weight types are laid out with an even number of blocks only
CASES = [(wt, odd) for wt in TILED for odd in ((False, True) if wt.block == 256 else (False,))]


@pytest.mark.parametrize(("wt", "odd"), CASES, ids=lambda c: getattr(c, "name", "odd" if c else "even"))
def test_laid_out_rows_give_the_split_rows_bits(wt: WeightType, odd: bool) -> None:
    k = _features(wt, odd)
    laid, split = _pair(wt, 48, k, seed=21)
    generator = torch.Generator().manual_seed(22)
    for rows in (1, 2, 3, 4, 9, 33):
        x = torch.randn(rows, k, generator=generator) * 3
        assert torch.equal(laid(x), split(x)[:, :48]), rows
        assert torch.equal(laid(x, wide=True), split(x, wide=True)[:, :48]), rows
    assert torch.equal(laid.weight, split.weight[:48])
    ops().set_int16_activations(False)
    try:
        x = torch.randn(5, k, generator=generator)
        assert torch.equal(laid(x), split(x)[:, :48])
        assert torch.equal(laid(x[:2]), split(x[:2])[:, :48])
    finally:
        ops().set_int16_activations(True)


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_an_embedding_reads_its_rows_back_from_the_laid_out_form(wt: WeightType) -> None:
    k = _features(wt, odd=True)
    packed = torch.from_numpy(_packed(wt, 64, k, seed=23))
    table, reference = QuantEmbedding(packed, wt.gguf_id, k), QuantLinear(packed, wt.gguf_id, k).weight
    ids = torch.tensor([[0, 63, 17], [16, 15, 40]])
    assert torch.equal(table(ids), reference[ids])


@pytest.mark.parametrize("wt", TILED, ids=lambda t: t.name)
def test_thread_ranges_that_start_inside_a_group_store_only_their_rows(wt: WeightType) -> None:
    """Two threads split 816 rows (AVX-512's groups of 16: at 408, half a group) or 824 (AVX2's
    groups of 8: at 412): each computes the group it shares and stores its own rows."""
    k = 8 * 256 if wt.block == 256 else 256 * 32  # decode's grain: 64 rows
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(25))
    for rows in (816, 824):
        packed = torch.from_numpy(_packed(wt, rows + 1, k, seed=rows))
        whole = QuantLinear(packed, wt.gguf_id, k)
        part = QuantLinear(packed[:rows].clone(), wt.gguf_id, k)
        for m in (1, 3):
            assert torch.equal(part(x[:m]), whole(x[:m])[:, :rows]), (rows, m)


def test_only_whole_groups_of_readable_rows_are_laid_out() -> None:
    q4_0, q6_k = TILED[0], TILED[-1]
    assert q4_0.name == "Q4_0" and q6_k.name == "Q6_K"

    def split(wt: WeightType, rows: int, k: int) -> torch.Tensor:
        return wt.split_rows(torch.from_numpy(_packed(wt, rows, k, seed=27)))

    assert lay_out(split(q6_k, 48, 1280), q6_k.gguf_id, 1280)
    assert not lay_out(split(q6_k, 47, 1280), q6_k.gguf_id, 1280)  # not whole groups
    assert lay_out(split(q4_0, 48, 14 * 32), q4_0.gguf_id, 14 * 32)
    assert not lay_out(split(q4_0, 48, 13 * 32), q4_0.gguf_id, 13 * 32)  # an odd block count
    before = split(q6_k, 48, 1280)
    after = before.clone()
    lay_out(after, q6_k.gguf_id, 1280)
    # the same bytes (reordered): resident weights stay the file's size
    assert np.array_equal(np.sort(before.numpy(), axis=None), np.sort(after.numpy(), axis=None))
