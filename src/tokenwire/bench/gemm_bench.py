"""`tokenwire bench gemm`: the quantised matmul (kernels/tiles.h) per weight type and number of
activation rows, GFLOP/s, against torch's fp32 matmul of the same dequantised weight and, with
`--against REV`, against the kernels of another git revision in the same process.

Why in one process: this machine is shared and its speed moves by 2x within minutes (8192x2048
Q4_K, M = 256, AVX2 build, six runs of one process per commit, alternating: 387, 329, 208, 298,
294, 315 GFLOP/s for one commit, 290, 382, 196, 210, 369, 234 for the other), so two runs of
`bench engine` cannot tell a 5% change. `--against` builds REV's kernel sources (`git show`) as a
second extension with its C++ namespace and torch library renamed (`twrev`), loads it beside
ours, and times the two calls alternately on the same tensors: each pair sees the same machine,
and the median of the pairs' ratios is the figure (new / REV; > 1: ours faster). Both take the
laid-out weights ours makes, so REV must read the same form (any revision since cfb7f5b; REV's
layout differing shows as a results mismatch, printed beside the ratio)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import cpp_extension

from tokenwire.bench.random_blocks import HALVES, random_blocks
from tokenwire.model import weight_types
from tokenwire.model.kernels import compiler_flags, kernel_path
from tokenwire.model.loader import default_cache_dir
from tokenwire.model.quant import QuantLinear

KERNELS = "src/tokenwire/model/kernels"
REV_LIBRARY = "twrev"
DEFAULT_TYPES = "Q4_0,Q4_K,Q6_K,Q8_0"


def renamed_sources(sources: dict[str, str], library: str = REV_LIBRARY) -> dict[str, str]:
    """Kernel sources (file name -> text) with namespace tw and the torch library `tokenwire`
    renamed, so a second build loads beside ours: same-named C++ symbols would otherwise bind to
    the first library loaded (inline and template functions are weak), and both would run one
    code."""
    out = {}
    for name, text in sources.items():
        text = re.sub(r"\bnamespace tw\b", f"namespace {library}_tw", text)
        text = re.sub(r"\btw::", f"{library}_tw::", text)
        text = re.sub(r"\bTORCH_LIBRARY(_IMPL)?\(tokenwire,", rf"TORCH_LIBRARY\1({library},", text)
        out[name] = text
    return out


def rev_sources(rev: str, repo: Path) -> dict[str, str]:
    """The kernel sources of git revision `rev` of `repo`."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout

    names = git("ls-tree", "--name-only", f"{rev}:{KERNELS}").split()
    return {n: git("show", f"{rev}:{KERNELS}/{n}") for n in names if re.search(r"\.(h|cpp)$", n)}


def load_rev(rev: str, repo: Path) -> Callable[..., torch.Tensor]:
    """REV's qmatmul, built (once per revision and flags) into the cache and loaded."""
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True
    )
    flags = compiler_flags()
    key = f"{commit.stdout.strip()[:12]}-{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}"
    build = default_cache_dir() / "kernels-rev" / key
    build.mkdir(parents=True, exist_ok=True)
    for name, text in renamed_sources(rev_sources(rev, repo)).items():
        path = build / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    cpp_extension.load(
        name=f"{REV_LIBRARY}_{key.replace('-', '_')}",
        sources=[str(build / "quant_cpu.cpp")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return getattr(torch.ops, REV_LIBRARY).qmatmul  # type: ignore[no-any-return]


def _layer(name: str, n: int, k: int) -> QuantLinear:
    wt = getattr(weight_types, name)
    if name in HALVES:  # K-quants: random valid blocks (gguf-py has no quantiser for them)
        return QuantLinear(
            torch.from_numpy(random_blocks(n, k, wt, 1, magnitude=(1e-4, 1e-1))), wt.gguf_id, k
        )
    rng = np.random.default_rng(1)
    return QuantLinear.from_float(
        torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05), wt.gguf_id
    )


def _timed(calls: list[Callable[[], Any]], reps: int) -> list[list[float]]:
    """Each call's seconds, `reps` rounds, the calls alternating within a round."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for f, ts in zip(calls, times, strict=True):
            start = time.perf_counter()
            f()
            ts.append(time.perf_counter() - start)
    return times


def _measure(
    name: str, layer: QuantLinear, m: int, rev: Callable[..., torch.Tensor] | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One (type, M) case: ours, fp32 torch on the dequantised weight and REV, interleaved."""
    n, k, qtype = layer.out_features, layer.in_features, layer.qtype
    dense = layer.weight
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    calls: list[Callable[[], Any]] = [lambda: layer(x), lambda: x @ dense.T]
    if rev is not None:
        calls.append(lambda: rev(x, layer.packed, qtype, True, False))
    for f in calls:
        f()  # warm: buffers, caches, the threads
    flop = 2 * n * k * m
    times = _timed(calls, max(args.min_calls, int(args.flop_budget / flop)))
    row: dict[str, Any] = {
        "type": name,
        "rows": m,
        "ours_gflops": flop / statistics.median(times[0]) / 1e9,
        "ours_gbs": layer.packed.numel() / statistics.median(times[0]) / 1e9,
        "fp32_gflops": flop / statistics.median(times[1]) / 1e9,
    }
    if rev is not None:
        y, y_rev = layer(x), rev(x, layer.packed, qtype, True, False)
        row["rev_gflops"] = flop / statistics.median(times[2]) / 1e9
        row["ours_over_rev"] = statistics.median(b / a for a, b in zip(times[0], times[2], strict=True))
        row["max_rel_diff"] = ((y - y_rev).abs().max() / y_rev.abs().max().clamp_min(1e-30)).item()
    return row


def run_gemm_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.size.split("x"))
    rev = load_rev(args.against, Path(args.repo)) if args.against else None
    rows = []
    for name in args.types.split(","):
        layer = _layer(name, n, k)
        rows += [_measure(name, layer, int(m), rev, args) for m in args.rows.split(",")]
    result = {
        "kernels": kernel_path(),
        "threads": torch.get_num_threads(),
        "size": f"{n}x{k}",
        "against": args.against,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokenwire bench gemm — {n}x{k}, {result['threads']} threads, medians of interleaved calls")
    print(f"kernels: {result['kernels']}")
    rev_cols = f"  {args.against[:12]:>12}  ours/rev  max rel diff" if rev is not None else ""
    print(f"{'type':7} {'M':>5}  {'ours GFLOP/s':>12}  {'GB/s':>6}  {'fp32 torch':>10}  ratio{rev_cols}")
    for r in rows:
        line = (
            f"{r['type']:7} {r['rows']:>5}  {r['ours_gflops']:>12.1f}  {r['ours_gbs']:>6.1f}  "
            f"{r['fp32_gflops']:>10.1f}  {r['ours_gflops'] / r['fp32_gflops']:>4.2f}x"
        )
        if rev is not None:
            line += f"  {r['rev_gflops']:>12.1f}  {r['ours_over_rev']:>7.3f}x  {r['max_rel_diff']:.1e}"
        print(line)
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser(
        "gemm", help="the quantised matmul per type and rows: GFLOP/s, against fp32 or a revision"
    )
    p.add_argument(
        "--types", default=DEFAULT_TYPES, help=f"weight types, comma-separated (default {DEFAULT_TYPES})"
    )
    p.add_argument("--rows", default="1,32,256", help="activation rows M, comma-separated (default 1,32,256)")
    p.add_argument("--size", default="8192x2048", help="the weight's N x K (default 8192x2048)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--against", metavar="REV", help="also time this git revision's kernels, interleaved")
    p.add_argument("--repo", default=".", help="the git checkout REV is read from (default: .)")
    p.add_argument("--min-calls", type=int, default=6, help="timed calls of each, at least (default 6)")
    p.add_argument("--flop-budget", type=float, default=1.5e10, help="flops timed per case (default 1.5e10)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_gemm_bench)
