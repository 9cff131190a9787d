"""Which llama.cpp the baseline runs: its kernels named from llama.cpp's own feature list, and the
AVX2-only build chosen exactly when our kernels run the AVX2 stand-in and that build exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.bench import llamacpp_baseline
from tokenwire.bench.llamacpp_baseline import kernels_of, peer_build

# llama_print_system_info() of llama-cpp-python 0.3.36 built natively on a Zen 5 EPYC, and of the
# same sdist built with -DGGML_NATIVE=OFF -DGGML_AVX2=ON (make bench-peer-avx2)
NATIVE = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
AVX2_ONLY = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
    "OPENMP = 1 | REPACK = 1 | "
)


def test_the_kernels_are_named_from_the_feature_list() -> None:
    assert kernels_of(NATIVE) == "AVX-512"
    assert kernels_of(AVX2_ONLY) == "AVX2"
    assert kernels_of("CPU : SSE3 = 1 | AVX2 = 0 | AVX512 = 0 | ") == "portable"


@pytest.mark.parametrize(
    ("isa", "installed", "chosen"),
    [("avx2", True, True), ("avx2", False, False), ("native", True, False), ("portable", True, False)],
)
def test_the_avx2_peer_runs_beside_the_avx2_stand_in_only(
    isa: str, installed: bool, chosen: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llamacpp_baseline, "AVX2_PEER_DIR", tmp_path)
    if installed:
        (tmp_path / "llama_cpp").mkdir()
    assert peer_build(isa) == (tmp_path if chosen else None)
