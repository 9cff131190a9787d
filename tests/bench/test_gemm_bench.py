"""bench gemm's --against: another revision's kernel sources renamed so they load beside ours
(the build and the timing are the bench's; the suite checks the rewriting and the CLI wiring)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tokenwire.bench.gemm_bench import KERNELS, renamed_sources, rev_sources
from tokenwire.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_a_revisions_sources_take_another_namespace_and_library() -> None:
    src = {
        "a.h": "namespace tw {\nstruct X {};\n}  // namespace tw\nint twin = tw::f(tw::kRows);\n",
        "quant_cpu.cpp": "TORCH_LIBRARY(tokenwire, m) {}\nTORCH_LIBRARY_IMPL(tokenwire, CPU, m) {}\n"
        'auto n = "tokenwire";\n',
    }
    out = renamed_sources(src, "twrev")
    assert (
        out["a.h"] == "namespace twrev_tw {\nstruct X {};\n}  // namespace twrev_tw\n"
        "int twin = twrev_tw::f(twrev_tw::kRows);\n"
    )
    assert out["quant_cpu.cpp"].startswith(
        "TORCH_LIBRARY(twrev, m) {}\nTORCH_LIBRARY_IMPL(twrev, CPU, m) {}\n"
    )
    assert 'auto n = "tokenwire";' in out["quant_cpu.cpp"]  # strings are not names: left alone


def test_the_real_kernels_keep_no_name_of_ours_after_renaming() -> None:
    """Every `namespace tw`, `tw::` and torch library of the kernels as committed is renamed: one
    left over would bind the second build's symbols to ours (both would run one code)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        sources = {p.name: p.read_text() for p in (ROOT / KERNELS).glob("*.[ch]*")}
    else:
        sources = rev_sources("HEAD", ROOT)
    assert "quant_cpu.cpp" in sources and "tiles.h" in sources
    for name, text in renamed_sources(sources).items():
        assert "namespace tw " not in text and "namespace tw\n" not in text, name
        assert " tw::" not in text and "(tw::" not in text and "<tw::" not in text, name
        assert "TORCH_LIBRARY(tokenwire," not in text and "TORCH_LIBRARY_IMPL(tokenwire," not in text, name


def test_bench_gemm_is_a_benchmark_of_the_command() -> None:
    args = build_parser(["bench"]).parse_args(
        ["bench", "gemm", "--types", "Q4_K", "--rows", "1,8", "--against", "HEAD~1"]
    )
    assert (args.types, args.rows, args.against) == ("Q4_K", "1,8", "HEAD~1")
