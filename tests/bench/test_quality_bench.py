"""`tokenwire bench quality` (bench/quality_bench.py) cut to short texts on the real default
model: the reference's rows and the decode pass's KL divergence from them, each KV type against
an fp32 cache with the same weights, ours against llama.cpp per position, and the command end to
end."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.bench_cli import bench_json
from tokenwire.bench.quality_bench import compare, paired, score_decode, score_kv_types, score_reference
from tokenwire.model.kernels import ops


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


def test_the_decode_pass_scores_its_kl_divergence_from_the_reference_rows(smollm2_engine) -> None:
    """score_reference keeps the dense fp32 pass's log-softmax rows (the file's weights
    dequantised, read a layer at a time; keys and values rounded as the engine's cache stores
    them); score_decode scores each decode step's KL against them: the fp32-activation decode
    pass (the same arithmetic up to fp32 order) near 0, the int8 one a larger KL that compare()
    averages."""
    engine = smollm2_engine
    tokens = engine.tokenizer.encode("The licenses for most software are designed to take away your freedom.")
    rows = np.zeros((len(tokens) - 1, engine.model.config.vocab_size), dtype=np.float32)
    reference = score_reference(engine, engine.kv.kv_dtype, tokens, rows)
    ops().set_int16_activations(False)  # the file's weights with exact activations
    try:
        exact = score_decode(engine, tokens, reference=rows)
    finally:
        ops().set_int16_activations(True)
    int8 = score_decode(engine, tokens, reference=rows)
    exact_kl, int8_kl = compare(reference, exact)["mean_kl"], compare(reference, int8)["mean_kl"]
    assert exact_kl is not None and int8_kl is not None
    assert -1e-6 <= exact_kl < 1e-4 and int8_kl > 10 * exact_kl, (exact_kl, int8_kl)
    assert [top for _, top, _ in exact] == [top for _, top, _ in reference]
    assert np.allclose(np.exp(rows.astype(np.float64)).sum(-1), 1, atol=1e-4)


def test_ours_against_llama_cpp_is_told_apart_from_chance_per_position() -> None:
    """paired(): each position's |Δlogprob| (and KL) of ours minus llama.cpp's, the mean and its
    standard error; positions either side scores no KL for are left out of the KL's."""
    nan = float("nan")
    reference = [(-1.0, 0, nan), (-2.0, 1, nan), (-3.0, 2, nan), (-4.0, 3, nan)]
    ours = [(-1.1, 0, 0.01), (-2.0, 1, 0.02), (-3.3, 2, 0.03), (-4.0, 3, nan)]
    theirs = [(-1.0, 0, 0.02), (-2.2, 1, 0.02), (-3.1, 2, 0.01), (-4.0, 3, 0.5)]
    out = paired(reference, ours, theirs)
    # |Δ| differences 0.1, -0.2, 0.2, 0: mean 0.025, sample deviation 0.17078
    assert out["abs_logprob_diff"]["mean"] == pytest.approx(0.025)
    assert out["abs_logprob_diff"]["stderr"] == pytest.approx(0.17078 / 2, rel=1e-4)
    # KL differences -0.01, 0, 0.02 (the fourth position has none of ours): sample deviation 0.015275
    assert out["kl"]["mean"] == pytest.approx(0.01 / 3)
    assert out["kl"]["stderr"] == pytest.approx(0.015275 / 3**0.5, rel=1e-4)


def test_quality_bench_json_scores_both_paths_against_the_reference() -> None:
    """`tokenwire bench quality --json` end to end on the default model, cut to 40 tokens: the
    reference (read a layer at a time) and the candidate come from the same files; llama.cpp's
    row and the per-position difference only where the bench extra is installed."""
    result = bench_json("quality", "--tokens=40", "--kv-types=")
    assert result["tokens"] == 40 and result["weights"] == "gguf" and result["reference_perplexity"] > 1
    assert result["kernels"].endswith(" build)")
    for path in ("prefill", "decode"):
        row = result[path]
        assert 0.8 <= row["top1_agreement"] <= 1  # the int8 path beside the exact model (96% on 2,000)
        assert 0 < row["mean_abs_logprob_diff"] <= row["max_abs_logprob_diff"] < 2
    assert result["prefill"]["mean_kl"] is None and 0 < result["decode"]["mean_kl"] < 0.05
    if "llamacpp" in result:
        assert result["llamacpp_kernels"]
        for measure in result["decode_minus_llamacpp"].values():
            assert measure["stderr"] > 0
    else:
        assert "decode_minus_llamacpp" not in result


def test_llama_cpp_is_started_for_our_kernels_instruction_set(smollm2_engine, monkeypatch) -> None:
    """The peer is llama.cpp's build for the instruction set our kernels run (the AVX2-only one
    on the AVX2 stand-in): before 00200d0 bench quality named none and ran the native build.
    The process is recorded here, not started: what is checked is what it is asked for."""
    from tokenwire.bench import llamacpp_baseline, quality_bench

    asked: list[tuple] = []
    monkeypatch.setattr(llamacpp_baseline, "available", lambda: True)
    monkeypatch.setattr(llamacpp_baseline, "LlamaCppProcess", lambda *args: asked.append(args) or "peer")
    monkeypatch.setattr(quality_bench.kernels, "isa_choice", lambda: "avx2")
    assert quality_bench.llamacpp_peer(smollm2_engine) == "peer"
    ((gguf, _threads, streams, _ctx, our_isa),) = asked
    assert gguf == smollm2_engine.source.source and streams == 1 and our_isa == "avx2"
