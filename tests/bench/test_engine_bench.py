"""`tokenwire bench engine --json` on the default model, cut to a few tokens: the keys the
Engine speed issue names (today's measures, prefill_1k, the weights run and their resident size).
llama.cpp is a `make bench` extra, so its keys are not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_bench_json_reports_every_measure() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenwire.cli",
            "bench",
            "engine",
            "--json",
            "--no-llamacpp",
            "--no-hf",
            "--decode-tokens=3",
            "--streams=2",
            "--prefill-tokens=40",
            "--session-tokens=40",
            "--repeats=1",
            "--kv-cache-mb=32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    for measure in ("single_stream", "streams_2", "prefill_1k"):
        assert result[measure]["tokenwire_tok_s"] > 0
        assert "llamacpp_tok_s" not in result[measure]  # not run: no ratio is made up
    assert result["turn2_ttft"]["reuse_s"] > 0 and result["turn2_ttft"]["ratio"] > 0
    assert result["weights"] == "gguf"
    assert result["decode"].startswith("fused")  # SmolLM2's layers are all the kernel's kind
    assert 0.9 < result["resident_weight_mb"] / result["gguf_mb"] < 1.3


def test_engine_bench_neighbours_report_the_speed_kept() -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "tokenwire.cli", "bench", "engine", "--json", "--no-llamacpp", "--no-hf"),
            *("--decode-tokens=3", "--streams=2", "--prefill-tokens=40", "--session-tokens=40"),
            *("--repeats=1", "--kv-cache-mb=32", "--neighbours=1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["neighbours"].startswith("1 nice-19 busy loop, each in its own session")
    for measure in ("single_stream", "streams_2", "prefill_1k"):
        row = result[measure]
        assert row["tokenwire_loaded_tok_s"] > 0
        assert row["tokenwire_kept"] == row["tokenwire_loaded_tok_s"] / row["tokenwire_tok_s"]


def test_busy_neighbours_run_niced_in_their_own_session_and_end() -> None:
    import os

    from tokenwire.bench.neighbours import busy_neighbours

    with busy_neighbours(2) as procs:
        for p in procs:
            assert p.poll() is None
            assert os.getsid(p.pid) == p.pid != os.getsid(0)
            assert os.getpriority(os.PRIO_PROCESS, p.pid) == 19
    assert all(p.poll() is not None for p in procs)
