"""`tokenwire bench spec --json` cut to a few tokens on the default model: each workload's speeds
with speculation off and on, and the counters behind them (llama.cpp is a `make bench` extra)."""

from __future__ import annotations

from tests.bench.bench_cli import bench_json


def test_spec_bench_json_reports_each_workload() -> None:
    result = bench_json(
        "spec",
        *("--no-llamacpp", "--repeats=1", "--edit-tokens=48", "--chat-tokens=8"),
        *("--streams=2", "--kv-cache-mb=64"),
    )
    assert 500 < result["edit_prompt_tokens"] < 900
    for workload in ("edit", "chat", "streams_2"):
        row = result[workload]
        assert row["on_tok_s"] > 0 and row["off_tok_s"] > 0
        assert row["ratio_vs_off"] == row["on_tok_s"] / row["off_tok_s"]
        assert "llamacpp_tok_s" not in row  # not run: no ratio is made up
        assert 0 <= row["acceptance"] <= 1 and row["forwards_per_token"] > 0
    # the edit answer copies its prompt: guesses are made and kept, fewer forward steps than
    # tokens. The share kept follows the guesses' length, which follows the timed cost of a row
    # (engine/speculation.py's StepCost): 0.26 in two runs, 0.47-0.56 in three others of one
    # sitting, so its bound is loose and the forwards are what must be fewer
    assert result["edit"]["acceptance"] > 0.15 and result["edit"]["forwards_per_token"] < 0.9
