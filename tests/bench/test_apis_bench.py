"""`tokenwire bench apis --json` cut to a few tokens on the default model: every API streams the
engine's greedy text through its own client in the bench's client process, and Responses'
chained turn 2 is measured against re-sending the conversation."""

from __future__ import annotations

from tests.bench.bench_cli import bench_json
from tokenwire.bench.api_clients import APIS


def test_apis_bench_json_reports_every_api_with_the_engines_text() -> None:
    result = bench_json("apis", "--repeats=1", "--tokens=6", "--history-tokens=200")
    assert set(result["apis"]) == {"engine", *APIS}
    for name, row in result["apis"].items():
        assert row["same_text"], name  # greedy parity with the engine, read through the API's stream
        assert row["tokens"] == 6, name  # from the API's own usage fields
        assert row["tok_s"] > 0 and row["ttft_s"] > 0, name
    turn2 = result["turn2"]
    assert turn2["history_tokens"] == 200
    assert turn2["chained_ttft_s"] > 0 and turn2["ratio"] == turn2["resent_ttft_s"] / turn2["chained_ttft_s"]
