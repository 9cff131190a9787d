"""End-to-end with the real default model: SmolLM2-135M-Instruct from the GGUF wheel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tokenwire.engine.request import GenerateOptions, SamplingParams

# "What is the capital of France?" alone was a near tie at the first token for the file's own
# values: "L" -1.956 against "The" -2.026 with exact activations (llama.cpp on the file: "L"
# too), so its greedy answer went either way with the activations' rounding; asked for a
# sentence, "The" leads "Paris" by 1.5 on every path
PROMPT = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def engine():
    """The default model with `--weights fp32`: the GGUF's exact values, as transformers runs them
    (the default, quantised engine's arithmetic is checked against this one below)."""
    from tokenwire.engine.factory import EngineSettings, build_engine

    fp32 = build_engine(EngineSettings(progress=False, kv_cache_mb=64, weights="fp32"))
    yield fp32
    fp32.shutdown()


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


def test_default_model_name_and_shape(engine) -> None:
    assert engine.name == "SmolLM2-135M-Instruct"
    assert engine.config.architecture == "LlamaForCausalLM" and engine.config.tie_word_embeddings
    assert engine.vocab_size == 49152


def test_logits_match_transformers(engine, hf) -> None:
    tokens = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(1, len(tokens))], top_logprobs=5)
    events, _ = engine.generate(None, tokens, opts).result()
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    expected = logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    got = torch.tensor([e.logprob for e in events])
    assert (got - expected).abs().max() <= 1e-4
    # the top-5 alternatives are transformers' top-5 at every position
    for e in events:
        ids = [t for t, _ in e.top_logprobs]
        assert ids == torch.topk(logp[e.position - 1], 5).indices.tolist()


def test_quantised_engine_logprobs_stay_within_the_int8_bounds(smollm2_engine, engine) -> None:
    """The default engine (the file's blocks, int8 activations with a wide head) against the
    exact values: prompt logprobs off by 5.6e-2 on average and 1.39 at most over 2,000 tokens
    of the GPL-3 in `tokenwire bench quality` (llama.cpp on the file: 6.0e-2, 0.87), the top
    token the same at 96.35% of positions (llama.cpp 96.35%); here held to mean <= 0.1, max <= 1.5
    and the same top at >= 90% of the prompt's positions: seen 0.074, 0.73 and 39 of 41 (int7
    activations would double the mean)."""
    tokens = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(1, len(tokens))], top_logprobs=1)
    exact, _ = engine.generate(None, tokens, opts).result()
    ours, _ = smollm2_engine.generate(None, tokens, opts).result()
    gaps = torch.tensor([a.logprob - b.logprob for a, b in zip(ours, exact, strict=True)]).abs()
    assert gaps.mean() <= 0.1 and gaps.max() <= 1.5, (gaps.mean(), gaps.max())
    same_top = [a.top_logprobs[0][0] == b.top_logprobs[0][0] for a, b in zip(ours, exact, strict=True)]
    assert sum(same_top) >= 0.9 * len(same_top), (sum(same_top), len(same_top))


def test_full_logit_rows_match_transformers(engine, hf) -> None:
    """Raw logits compared directly through a whole-sequence tensor call on the model thread."""
    from tokenwire.model.layers.attention import DenseCausalAttention

    tokens = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)

    def ours():
        ids = torch.tensor(tokens)
        hidden, _ = engine.model(ids, torch.arange(len(tokens)), DenseCausalAttention(1, len(tokens)))
        return engine.model.logits(hidden)

    got = engine.call_on_model_thread(ours).result()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    assert (got - expected).abs().max() <= 1e-4


def test_greedy_64_tokens_equal_transformers(engine, hf) -> None:
    tokens = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a robot."}]
    )
    events, _ = engine.generate(
        None,
        tokens,
        GenerateOptions(max_tokens=64, sampling=SamplingParams(temperature=0.0), ignore_eos=True),
    ).result()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([tokens]), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
        )
    assert [e.token_id for e in events] == out[0, len(tokens) :].tolist()


def test_regex_constraint_with_real_model(engine) -> None:
    import re

    from tokenwire.engine.grammar import GrammarConstraint

    pattern = r"The answer is [0-9]{2}\."
    tokens = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Pick a number."}])
    constraint = GrammarConstraint.regex(engine.tokenizer.hf, engine.logits_size, pattern)
    events, finish = engine.generate(
        None,
        tokens,
        GenerateOptions(
            max_tokens=20, constraint=constraint, sampling=SamplingParams(temperature=0.8, seed=3)
        ),
    ).result()
    text = "".join(e.text for e in events if e.token_id not in engine.eos_ids)
    assert re.fullmatch(pattern, text), text
    assert finish.reason in ("eos", "stop")


def generate_cli(*flags: str) -> str:
    """`tokenwire generate PROMPT` greedy, as a user runs it; returns stdout."""
    cmd = [
        sys.executable,
        "-m",
        "tokenwire.cli",
        "generate",
        PROMPT,
        "--temperature",
        "0",
        "--kv-cache-mb",
        "64",
    ]
    out = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cli_generate_answers_paris() -> None:
    stdout = generate_cli("--max-tokens", "40")
    assert "Paris" in stdout, stdout


def test_cli_generate_json_events() -> None:
    lines = [json.loads(line) for line in generate_cli("--max-tokens", "5", "--json").splitlines()]
    assert [x["type"] for x in lines] == ["token"] * 5 + ["finish"]
    assert lines[-1]["reason"] == "length" and lines[-1]["completion_tokens"] == 5
