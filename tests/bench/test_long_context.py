"""decode_at_4k / decode_at_8k (bench/long_context.py), cut to short contexts on the real default
model: one engine per KV type over the same weights, each context prefilled once and then kept
by the prefix cache, the same requests streamed through a real OpenAI server on 127.0.0.1
(served), the KV GB/s a decode step reads, and the bytes a token takes in each cache."""

from __future__ import annotations

from tokenwire.bench.long_context import print_long_context, run_long_context


def test_long_context_measures_each_kv_type(smollm2_engine, capsys) -> None:
    contexts = {"decode_at_4k": 40, "decode_at_8k": 70}
    result = run_long_context(smollm2_engine, None, ["fp16", "q8"], 4, 2, contexts)
    for measure, n in contexts.items():
        assert result[measure]["context"] == n
        for kv in ("fp16", "q8"):
            cell = result[measure][kv]
            assert cell["tokenwire_tok_s"] > 0 and "llamacpp_tok_s" not in cell  # no peer: no ratio
            assert cell["served_tok_s"] > 0  # the OpenAI API's stream of the same request
            # the cache a step reads (context x bytes a position) times steps/s, a step <= a token
            per_step = n * result["kv_bytes_per_token"][kv]
            assert cell["tokenwire_kv_gb_s"] == per_step * cell["tokenwire_steps_s"] / 1e9
            assert 0 < cell["tokenwire_steps_s"] <= cell["tokenwire_tok_s"] * 1.0001
    # SmolLM2: 30 layers x 3 KV heads x 64 values, keys and values
    values = 2 * 30 * 3 * 64
    assert result["kv_bytes_per_token"] == {
        "fp16": 2 * values,
        "q8": values * 34 / 32,
        "llamacpp_f16": 2 * values,
        "llamacpp_q8_0": values * 34 / 32,
    }
    assert smollm2_engine.stats()["running"] == 0  # the shared model is the bench engine's again
    print_long_context(result, ["fp16", "q8"])
    out = capsys.readouterr().out
    assert "decode_at_8k (70) q8" in out and "KV bytes per token: fp16 22.5 KiB, q8 12.0 KiB" in out
    assert "served" in out and "KV read per decode step" in out
