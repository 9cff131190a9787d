"""`tokenwire bench engine --json` on the default model, cut to a few tokens: the keys the
Engine speed issue names (today's measures, the prefill under its length's name, the weights
run and their resident size, the weight bandwidth, the load's time and peak RSS). llama.cpp is
a `make bench` extra, so its keys are not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenwire.bench.engine_bench import steps_per_s


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
            "--long-kv=",  # decode_at_4k/8k: test_long_context.py
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    for measure in ("single_stream", "streams_2", "prefill_40"):  # --prefill-tokens=40
        assert result[measure]["tokenwire_tok_s"] > 0
        # each round's figure beside the median: one round here (--repeats=1)
        assert result[measure]["tokenwire_rounds_tok_s"] == [result[measure]["tokenwire_tok_s"]]
        assert "llamacpp_tok_s" not in result[measure]  # not run: no ratio is made up
        assert "rounds_ratio_vs_llamacpp" not in result[measure]
    assert "prefill_1k" not in result  # a 40-token prompt is not named a 1k one
    assert result["turn2_ttft"]["reuse_s"] > 0 and result["turn2_ttft"]["ratio"] > 0
    assert result["weights"] == "gguf"
    assert result["decode"].startswith("fused")  # SmolLM2's layers are all the kernel's kind
    assert 0.9 < result["resident_weight_mb"] / result["gguf_mb"] < 1.3
    assert result["shape"] is None and result["quant"] is None and result["gguf_written_s"] is None
    # SmolLM2's tied head is its 28.7 MiB Q8_0 embedding; its layers' Q4_1 matrices are 63.3 MiB
    assert 91 < result["weight_mb_per_step"] < 93 < result["gguf_mb"] < 95
    for measure in ("single_stream", "streams_2", "prefill_40"):  # --prefill-tokens=40
        row = result[measure]
        steps = steps_per_s(measure, row["tokenwire_tok_s"], 2, 40, 512)
        assert row["tokenwire_weight_gb_s"] == pytest.approx(
            result["weight_mb_per_step"] * 2**20 * steps / 1e9
        )
        assert "llamacpp_weight_gb_s" not in row
    assert result["load_s"] > 0 and result["load_cold"] in (True, False)
    assert result["llamacpp_load_s"] is None
    # a warm load in a fresh process: its peak RSS holds at least the weights, and the KV cache
    # asked for is the one the target counts
    assert 30 < result["kv_cache_mb"] <= 32 and result["load_warm_s"] > 0  # whole KV blocks of 32 MiB
    assert result["load_rss_before_mb"] + 0.9 * result["gguf_mb"] < result["load_peak_rss_mb"]
    assert result["load_rss_target_mb"] == pytest.approx(result["gguf_mb"] + result["kv_cache_mb"] + 300)


def test_engine_bench_neighbours_report_the_speed_kept() -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "tokenwire.cli", "bench", "engine", "--json", "--no-llamacpp", "--no-hf"),
            *("--decode-tokens=3", "--streams=2", "--prefill-tokens=40", "--session-tokens=40"),
            *("--repeats=1", "--kv-cache-mb=32", "--neighbours=1", "--no-load-probe", "--long-kv="),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["neighbours"].startswith("1 nice-19 busy loop, each in its own session")
    assert "load_peak_rss_mb" not in result  # --no-load-probe
    for measure in ("single_stream", "streams_2", "prefill_40"):  # --prefill-tokens=40
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--shape", "llama-70b"],
            "tokenwire: error: unknown --shape 'llama-70b': one of smollm2-135m, llama-1b,",
        ),
        (["--shape", "llama-1b", "--quant", "Q4_K"], "tokenwire: error: unknown --quant 'Q4_K': one of F32,"),
    ],
)
def test_an_unknown_shape_or_quant_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenwire.cli import main

    assert main(["bench", "engine", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
