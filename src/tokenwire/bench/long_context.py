"""`tokenwire bench engine`'s long-context measures: decode_at_4k and decode_at_8k.

Single-stream greedy decode (the first token's time, which includes the prefill, excluded) after
a context of 4,096 / 8,192 tokens, for each of our KV types (--long-kv, default fp16 and q8),
each beside llama.cpp on the same GGUF with the cache type that matches it: its default f16
beside fp16 (and fp32, bf16), q8_0 beside q8. Every decoded token reads the whole cache, so these
measure the attention at the memory wall (issue 26). The 8k context is cut to the model's length
less the decoded tokens where the model is shorter (SmolLM2: 8,192 positions in all).

Our engine for each KV type shares the bench engine's weights (an Engine over the same module,
its own cache); each context is prefilled once per engine (the prefix cache keeps it, llama.cpp
keeps its context and drops only the decoded tokens), so the rounds measure decode alone.

Served (issue 45): the same request streamed through the OpenAI API, from a real server on
127.0.0.1 in this process over the same engine (bench/served_long.py), in the same rounds: what
a user of `tokenwire serve` meets. KV GB/s: the cache one decode step reads (the context's
positions times the bytes a position takes) times decode steps per second; our steps are
counted (a step may yield several tokens where prompt-lookup guesses are kept), llama.cpp's are
its tokens.
"""

from __future__ import annotations

import statistics
from typing import Any

from tokenwire.bench.llamacpp_baseline import LlamaCppProcess
from tokenwire.bench.measures import ours_single, ours_single_steps
from tokenwire.bench.served_long import ServedEngine
from tokenwire.engine.engine import Engine
from tokenwire.engine.kv_cache import kv_bytes_per_token

CONTEXTS = {"decode_at_4k": 4096, "decode_at_8k": 8192}
PEER_KV = {"fp32": "f16", "fp16": "f16", "bf16": "f16", "q8": "q8_0"}  # llama.cpp's cache beside ours
_PEER_BYTES = {"f16": 2.0, "q8_0": 34 / 32}  # bytes a value: q8_0 blocks are 32 int8 + an fp16 scale


def context_tokens(engine: Engine, wanted: int, decode_tokens: int) -> list[int]:
    """`wanted` tokens of plain text (repeated as needed), at most the model's length less the
    decoded tokens."""
    tok = engine.tokenizer
    text = " ".join(
        f"Entry {i}: the ferry leaves pier {i * 13 % 89} at dawn and returns by dusk." for i in range(2000)
    )
    base = tok.encode(text)
    n = min(wanted, engine.max_model_len - decode_tokens)
    return (base * (n // len(base) + 1))[:n]


def kv_engine(engine: Engine, kv_dtype: str, tokens: int) -> Engine:
    """An engine over `engine`'s model with its own `kv_dtype` cache of room for `tokens`."""
    config = engine.model.config
    mb = (tokens + 64) * kv_bytes_per_token(config, kv_dtype) / 2**20
    return Engine(engine.model, engine.tokenizer, name=engine.name, kv_cache_mb=mb, kv_dtype=kv_dtype)


def run_long_context(
    engine: Engine,
    llama: LlamaCppProcess | None,
    kv_dtypes: list[str],
    decode_tokens: int,
    repeats: int,
    contexts: dict[str, int] = CONTEXTS,
    served: bool = True,
) -> dict[str, Any]:
    """{measure: {"context": tokens, kv_dtype: {tokenwire_tok_s, llamacpp_tok_s, ratio...}}} and
    kv_bytes_per_token of each of ours and each of llama.cpp's cache types."""
    prompts = {m: context_tokens(engine, n, decode_tokens) for m, n in contexts.items()}
    longest = max(len(p) for p in prompts.values()) + decode_tokens
    ours: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    over_api: dict[tuple[str, str], list[float]] = {}
    peer: dict[tuple[str, str], list[float]] = {}
    engines = {kv: kv_engine(engine, kv, 2 * longest) for kv in kv_dtypes}
    servers = {kv: ServedEngine(e) for kv, e in engines.items()} if served else {}
    try:
        for server in servers.values():
            server.__enter__()
        for e in engines.values():  # prefill each context once (the prefix cache keeps it)
            for prompt in prompts.values():
                ours_single(e, prompt, 2, use_prefix_cache=True)
        for _ in range(repeats):
            for measure, prompt in prompts.items():
                for kv, e in engines.items():
                    tok_s, steps_s = ours_single_steps(e, prompt, decode_tokens, use_prefix_cache=True)
                    ours.setdefault((measure, kv), []).append(tok_s)
                    steps.setdefault((measure, kv), []).append(steps_s)
                    if kv in servers:
                        over_api.setdefault((measure, kv), []).append(
                            servers[kv].decode_tok_s(prompt, decode_tokens)
                        )
                    if llama is not None:
                        peer.setdefault((measure, kv), []).append(
                            llama.long_decode(prompt, decode_tokens, PEER_KV[kv])
                        )
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
        for e in engines.values():
            e.shutdown()
    config = engine.model.config
    values = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    result: dict[str, Any] = {}
    for measure, prompt in prompts.items():
        row: dict[str, Any] = {"context": len(prompt)}
        for kv in kv_dtypes:
            cell: dict[str, Any] = {"tokenwire_tok_s": statistics.median(ours[(measure, kv)])}
            step_bytes = len(prompt) * kv_bytes_per_token(config, kv)  # the cache a decode step reads
            cell["tokenwire_steps_s"] = statistics.median(steps[(measure, kv)])
            cell["tokenwire_kv_gb_s"] = step_bytes * cell["tokenwire_steps_s"] / 1e9
            if (measure, kv) in over_api:
                cell["served_tok_s"] = statistics.median(over_api[(measure, kv)])
            if (measure, kv) in peer:
                cell["llamacpp_kv"] = PEER_KV[kv]
                cell["llamacpp_tok_s"] = statistics.median(peer[(measure, kv)])
                cell["llamacpp_kv_gb_s"] = (
                    len(prompt) * values * _PEER_BYTES[PEER_KV[kv]] * cell["llamacpp_tok_s"] / 1e9
                )
                cell["ratio_vs_llamacpp"] = cell["tokenwire_tok_s"] / cell["llamacpp_tok_s"]
                if "served_tok_s" in cell:
                    cell["served_ratio_vs_llamacpp"] = cell["served_tok_s"] / cell["llamacpp_tok_s"]
            row[kv] = cell
        result[measure] = row
    result["kv_bytes_per_token"] = {
        **{kv: kv_bytes_per_token(config, kv) for kv in kv_dtypes},
        **{f"llamacpp_{t}": values * b for t, b in _PEER_BYTES.items()},
    }
    return result


def print_long_context(result: dict[str, Any], kv_dtypes: list[str]) -> None:
    print(f"{'long context':<24}{'tokenwire':>14}{'llama.cpp':>20}{'ratio':>8}{'served':>14}{'ratio':>8}")
    for measure in [m for m in CONTEXTS if m in result]:
        row = result[measure]
        for kv in kv_dtypes:
            cell = row[kv]
            peer = (
                f"{cell['llamacpp_tok_s']:>9.1f} t/s ({cell['llamacpp_kv']:>4})"
                if "llamacpp_tok_s" in cell
                else f"{'-':>20}"
            )
            ratio = f"{cell['ratio_vs_llamacpp']:>7.2f}x" if "ratio_vs_llamacpp" in cell else f"{'':>8}"
            served = f"{cell['served_tok_s']:>10.1f} t/s" if "served_tok_s" in cell else f"{'-':>14}"
            served_ratio = (
                f"{cell['served_ratio_vs_llamacpp']:>7.2f}x" if "served_ratio_vs_llamacpp" in cell else ""
            )
            label = f"{measure} ({row['context']}) {kv}"
            print(f"{label:<24}{cell['tokenwire_tok_s']:>10.1f} t/s{peer}{ratio}{served}{served_ratio}")
    print("served: the same request streamed through the OpenAI API (server on 127.0.0.1, this process)")
    print(
        f"{'KV read per decode step':<24}{'tokenwire':>14}{'llama.cpp':>14}"
        "   (context x bytes a position x steps/s)"
    )
    for measure in [m for m in CONTEXTS if m in result]:
        row = result[measure]
        for kv in kv_dtypes:
            cell = row[kv]
            peer = f"{cell['llamacpp_kv_gb_s']:>9.1f} GB/s" if "llamacpp_kv_gb_s" in cell else f"{'-':>14}"
            label = f"{measure} {kv}"
            print(
                f"{label:<24}{cell['tokenwire_kv_gb_s']:>9.1f} GB/s{peer}"
                f"   ({cell['tokenwire_steps_s']:.1f} steps/s for {cell['tokenwire_tok_s']:.1f} tok/s)"
            )
    sizes = ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in result["kv_bytes_per_token"].items())
    print(f"KV bytes per token: {sizes}")
