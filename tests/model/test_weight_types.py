"""The weight-type table: the Python rows (model/weight_types.py) mirror the C++ ones
(kernels/type_table.h), and each row's reference dequantiser and split layout are right."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tokenwire.bench.random_blocks import HALVES, random_blocks
from tokenwire.model import weight_types
from tokenwire.model.kernels import compiler_flags, ops
from tokenwire.model.quant import dequantize, quantize
from tokenwire.model.weight_types import WEIGHT_TYPES, WeightType, weight_type


def _blocks(rows: int, cols: int, wt: WeightType, seed: int = 0) -> np.ndarray:
    if wt.name in HALVES:  # K-quants: gguf-py has no quantiser for them
        return random_blocks(rows, cols, wt, seed)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    w[0, : wt.block] = 0  # an all-zero block
    packed = quantize(torch.from_numpy(w), wt.gguf_id)  # gguf's quantiser, or ours where it has none
    return packed.numpy()


def test_python_and_cpp_tables_agree() -> None:
    """Same types, and per type the same name, block size, bytes per block, split-row parts and
    activation format (none in a build without AVX2, where no integer dot exists; the tiled
    types' int8 format on AVX2 and AVX-512 alike)."""
    assert sorted(ops().weight_type_ids()) == sorted(t.gguf_id for t in WEIGHT_TYPES)
    avx2 = "-mavx2" in compiler_flags()
    for wt in WEIGHT_TYPES:
        name, activation, sizes = ops().weight_type_info(wt.gguf_id)
        expected = [wt.block, wt.block_bytes, *(size for _, size in wt.parts)]
        want = wt.activation if avx2 else ""
        assert (name, activation, sizes) == (wt.name, want, expected)
        assert wt.name == GGMLQuantizationType(wt.gguf_id).name
    with pytest.raises(RuntimeError, match="unsupported quantisation type 16"):
        ops().weight_type_info(16)  # IQ2_XXS


@pytest.mark.parametrize("wt", WEIGHT_TYPES, ids=lambda t: t.name)
def test_row_sizes_match_gguf(wt: WeightType) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert GGML_QUANT_SIZES[GGMLQuantizationType(wt.gguf_id)] == (wt.block, wt.block_bytes)


@pytest.mark.parametrize("wt", WEIGHT_TYPES, ids=lambda t: t.name)
def test_reference_dequantiser_is_bit_exact_with_gguf_and_the_kernels(wt: WeightType) -> None:
    packed = _blocks(19, 5 * wt.block, wt)
    ours = wt.dequantize_reference(packed)
    assert ours.dtype == np.float32 and ours.shape == (19, 5 * wt.block)
    reference = np.asarray(gguf_dequantize(packed, GGMLQuantizationType(wt.gguf_id)), dtype=np.float32)
    np.testing.assert_array_equal(ours, reference)
    kernels = dequantize(torch.from_numpy(packed), wt.gguf_id, 5 * wt.block).numpy()
    np.testing.assert_array_equal(kernels, ours)


@pytest.mark.parametrize("wt", WEIGHT_TYPES, ids=lambda t: t.name)
def test_split_rows_puts_each_part_of_every_block_together(wt: WeightType) -> None:
    """Part p of block j of a row lands at nb * (bytes of the parts before p) + j * (its bytes)."""
    nb, rows = 3, 2
    packed = torch.arange(rows * nb * wt.block_bytes, dtype=torch.int64).view(rows, -1)
    split = wt.split_rows(packed)
    assert split.shape == packed.shape
    for r in range(rows):
        start = 0
        for _, size in wt.parts:
            for j in range(nb):
                block = packed[r, j * wt.block_bytes : (j + 1) * wt.block_bytes]
                got = split[r, nb * start + j * size : nb * start + (j + 1) * size]
                assert torch.equal(got, block[start : start + size])
            start += size


def test_unknown_types_are_named() -> None:
    with pytest.raises(ValueError, match="unsupported quantisation type 16"):
        weight_type(16)  # IQ2_XXS: converted to Q8_0, never run as itself
    assert weight_type(8) is weight_types.Q8_0


def test_the_isa_can_be_narrowed_to_build_the_avx2_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENWIRE_KERNELS_ISA=avx2 builds what an AVX2-only CPU builds (CI may land on one), as a
    build of its own in the kernel cache; =portable drops the vector paths; a typo is refused."""
    from tokenwire.model import kernels

    monkeypatch.delenv(kernels.ISA_ENV, raising=False)  # the suite itself may run with it set
    native = compiler_flags()
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    avx2 = compiler_flags()
    assert not any(f.startswith("-mavx512") for f in avx2)
    assert ("-mavx2" in avx2) == ("-mavx2" in native)
    avx2_dir = kernels.kernel_dir()
    monkeypatch.delenv(kernels.ISA_ENV)
    assert (avx2_dir == kernels.kernel_dir()) == (avx2 == native)  # the build's key has the flags
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    monkeypatch.setenv(kernels.ISA_ENV, "portable")
    assert not any(f.startswith("-mavx") or f in ("-mfma", "-mf16c") for f in compiler_flags())
    monkeypatch.setenv(kernels.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="TOKENWIRE_KERNELS_ISA"):
        compiler_flags()


def test_a_built_library_is_loaded_as_it_is_whatever_the_sources_mtimes(tmp_path: Path) -> None:
    """The kernel directory is named by the sources' hash, so a library found there is loaded
    without ninja (which rebuilt it, 45-57 s, whenever a source's mtime was newer: a checkout, a
    fresh clone on a machine that had built it). A fresh process with its cache in tmp_path
    holding only the built library: it loads it, writes no build files and its ops run."""
    from tokenwire.model import kernels

    kernels.load_kernels()
    built = kernels.kernel_dir() / "tokenwire_quant_cpu.so"
    cache = tmp_path / "cache"
    target = cache / kernels.kernel_dir().relative_to(kernels.default_cache_dir())
    target.mkdir(parents=True)
    shutil.copy(built, target / built.name)
    os.utime(target / built.name, (0, 0))  # older than every source
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from tokenwire.model import kernels; kernels.load_kernels()\n"
        "print(kernels.kernel_dir()); print(torch.ops.tokenwire.paged_attention is not None)\n"
    )
    env = dict(os.environ, TOKENWIRE_CACHE_DIR=str(cache))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(target), "True"]
    assert "tokenwire CPU kernels loaded" in run.stderr and "compil" not in run.stderr
    assert sorted(p.name for p in target.iterdir()) == [built.name]  # no build.ninja, no object
