"""`tokenwire bench quality`'s KV rows (bench/quality_bench.py score_kv_types), cut to a short
text on the real default model: each KV type against an fp32 cache with the same weights."""

from __future__ import annotations

from tokenwire.bench.quality_bench import score_kv_types


def test_each_kv_type_is_scored_against_an_fp32_cache(smollm2_engine) -> None:
    engine = smollm2_engine
    tokens = engine.tokenizer.encode(
        "The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion of the transport costs, the members agreed to postpone the vote until the "
        "next meeting, when the treasurer would present a revised estimate."
    )
    result = score_kv_types(engine, tokens, ["fp16", "q8"])
    assert result["fp32_kv_perplexity"] > 1
    for kv, bound in (("fp16", 0.05), ("q8", 0.5)):  # |dlogprob| far under a token's worth
        row = result[kv]
        assert row["top1_agreement"] >= 0.9 and row["max_abs_logprob_diff"] <= bound
        assert 0 < row["mean_abs_logprob_diff"] <= row["max_abs_logprob_diff"]
    assert result["fp16"]["mean_abs_logprob_diff"] < result["q8"]["mean_abs_logprob_diff"]
    peer = result.get("llamacpp_q8_0_vs_f16")  # only where the bench extra is installed
    assert peer is None or 0 <= peer["top1_agreement"] <= 1
