"""`tokenwire bench quality`: the quantised path's logits against the fp32 reference.

Both run the same GGUF: the reference dequantises it to fp32 (`--weights fp32`); the candidate
keeps its blocks (`--weights gguf`, or what --weights names). The text is teacher-forced: every
position's logprob of the true next token and the top-1 token are compared. The candidate is
measured twice, because the two paths differ: prefill (512-token chunks) and decode (one token
per step through the fused decode kernel, as generation runs). Both with the engine's KV type
(--kv-dtype). Then each KV type of --kv-types against an fp32 cache, with the candidate's
weights: the cache's rounding alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenwire.bench import llamacpp_baseline
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.kv_cache import KVCache, kv_bytes_per_token
from tokenwire.engine.request import GenerateOptions, TokenEvent
from tokenwire.model.layers.decoder import PagedDecode

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # plain English prose on every Debian machine

Scored = list[tuple[float, int]]  # per position p >= 1: (logprob of token p, top-1 token id)


def score_prefill(engine: Engine, tokens: list[int]) -> Scored:
    opts = GenerateOptions(
        max_tokens=0, logprob_ranges=[(1, len(tokens))], top_logprobs=1, use_prefix_cache=False
    )
    events, _ = engine.generate(None, tokens, opts).result()
    return [(e.logprob, e.top_logprobs[0][0]) for e in events if isinstance(e, TokenEvent)]


def score_decode(engine: Engine, tokens: list[int]) -> Scored:
    """One token per model step, as generation runs: each step is a PagedDecode batch of one row
    (the fused decode kernel when the model has it) over a KV cache of its own."""

    def run() -> Scored:
        model = engine.model
        block = 16
        blocks = -(-len(tokens) // block)
        kv = KVCache(model.config, blocks, block, engine.kv.kv_dtype, model.device)
        table = torch.arange(blocks, dtype=torch.long)[None]
        out: Scored = []
        with torch.inference_mode():
            for p in range(len(tokens) - 1):
                pos = torch.tensor([p])
                hidden, _ = model(
                    torch.tensor(tokens[p : p + 1]),
                    pos,
                    PagedDecode(kv.k, kv.v, pos, table, kv.k_scale, kv.v_scale),
                )
                logp = torch.log_softmax(model.logits(hidden)[0], -1)
                out.append((float(logp[tokens[p + 1]]), int(logp.argmax())))
        return out

    return engine.call_on_model_thread(run).result()


def compare(reference: Scored, candidate: Scored) -> dict[str, float]:
    diffs = [abs(a - b) for (a, _), (b, _) in zip(reference, candidate, strict=True)]
    agree = sum(ra == ca for (_, ra), (_, ca) in zip(reference, candidate, strict=True))
    return {
        "top1_agreement": agree / len(reference),
        "mean_abs_logprob_diff": statistics.fmean(diffs),
        "max_abs_logprob_diff": max(diffs),
        "perplexity": math.exp(-statistics.fmean(lp for lp, _ in candidate)),
    }


def run_quality_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    reference_engine = build_engine(replace(settings, weights="fp32"))
    try:
        tokens = reference_engine.tokenizer.encode(text)[: args.tokens]
        reference = score_prefill(reference_engine, tokens)
        gguf = reference_engine.source.source if reference_engine.source is not None else None
    finally:
        reference_engine.shutdown()
    llamacpp = score_llamacpp(gguf, tokens)
    engine = build_engine(settings)
    kv_types = [kv for kv in args.kv_types.split(",") if kv]
    try:
        weights, kv_dtype = engine.weights, engine.kv.kv_dtype
        prefill = score_prefill(engine, tokens)
        decode = score_decode(engine, tokens)
        by_kv = score_kv_types(engine, tokens, kv_types) if kv_types else None
    finally:
        engine.shutdown()
    result = {
        "weights": weights,
        "tokens": len(tokens),
        "reference_perplexity": math.exp(-statistics.fmean(lp for lp, _ in reference)),
        "prefill": compare(reference, prefill),
        "decode": compare(reference, decode),
        "kv_dtype": kv_dtype,
    }
    if llamacpp is not None:  # llama.cpp on the same file and text, against the same reference
        result["llamacpp"] = compare(reference, llamacpp)
    if by_kv is not None:
        result["kv_vs_fp32_kv"] = by_kv
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokenwire bench quality — {engine.name}: {weights} vs fp32 (dequantised), {len(tokens)} tokens")
    print(f"{'path':<10}{'top-1 agree':>13}{'mean |dlogp|':>14}{'max |dlogp|':>13}{'perplexity':>12}")
    print(f"{'fp32 ref':<10}{'':>13}{'':>14}{'':>13}{result['reference_perplexity']:>12.3f}")
    for path in ("prefill", "decode", "llamacpp"):
        if path not in result:
            continue
        r = result[path]
        print(
            f"{path:<10}{r['top1_agreement'] * 100:>12.2f}%{r['mean_abs_logprob_diff']:>14.2e}"
            f"{r['max_abs_logprob_diff']:>13.2e}{r['perplexity']:>12.3f}"
        )
    print(f"text: {args.text}, teacher-forced; decode = one token per step through the fused kernel")
    print(f"KV cache: {kv_dtype} in the rows above")
    if by_kv is not None:
        print(
            f"\n{'KV type':<10}{'top-1 agree':>13}{'mean |dlogp|':>14}{'max |dlogp|':>13}{'perplexity':>12}"
            "   (prefill, the same weights, against an fp32 cache)"
        )
        print(f"{'fp32':<10}{'':>13}{'':>14}{'':>13}{by_kv['fp32_kv_perplexity']:>12.3f}")
        for kv in [*kv_types, "llamacpp_q8_0_vs_f16"]:
            if kv not in by_kv:
                continue
            r = by_kv[kv]
            print(
                f"{kv:<10}{r['top1_agreement'] * 100:>12.2f}%{r['mean_abs_logprob_diff']:>14.2e}"
                f"{r['max_abs_logprob_diff']:>13.2e}{r['perplexity']:>12.3f}"
            )
    return 0


def score_llamacpp(gguf: Path | None, tokens: list[int]) -> Scored | None:
    """llama.cpp's own teacher-forced scores of the text (its f16 cache, 512-token batches), where
    the model is a GGUF and the `bench` extra is installed: the peer the quantised path is held
    to (issue 42: at least as faithful as llama.cpp on the same file)."""
    if gguf is None or gguf.suffix.lower() != ".gguf" or not llamacpp_baseline.available():
        return None
    llama = llamacpp_baseline.LlamaCppProcess(gguf, torch.get_num_threads(), 1, 512)
    try:
        return llama.teacher_forced(tokens, "f16")
    finally:
        llama.close()


def score_kv_types(engine: Engine, tokens: list[int], kv_types: list[str]) -> dict[str, Any]:
    """The text prefilled with the engine's weights and each KV type, against an fp32 cache:
    every position's attention reads the keys and values as the cache stores them."""
    mb = 2 * len(tokens) * kv_bytes_per_token(engine.model.config, "fp32") / 2**20

    def scored(kv: str) -> Scored:
        other = Engine(engine.model, engine.tokenizer, name=engine.name, kv_cache_mb=mb, kv_dtype=kv)
        try:
            return score_prefill(other, tokens)
        finally:
            other.shutdown()

    reference = scored("fp32")
    out: dict[str, Any] = {"fp32_kv_perplexity": math.exp(-statistics.fmean(lp for lp, _ in reference))}
    for kv in kv_types:
        out[kv] = compare(reference, scored(kv))
    gguf = engine.source.source if engine.source is not None else None
    if gguf is not None and gguf.suffix.lower() == ".gguf" and llamacpp_baseline.available():
        # llama.cpp's own q8_0 cache against its f16 one, the same text, the same measures
        llama = llamacpp_baseline.LlamaCppProcess(gguf, torch.get_num_threads(), 1, 512)
        try:
            out["llamacpp_q8_0_vs_f16"] = compare(
                llama.teacher_forced(tokens, "f16"), llama.teacher_forced(tokens, "q8_0")
            )
        finally:
            llama.close()
    return out


def add_quality_parser(
    bench_sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    add_model_args: Callable[[argparse.ArgumentParser], None],
    settings_from: Callable[[argparse.Namespace], EngineSettings],
) -> None:
    bq = bench_sub.add_parser("quality", help="quantised weights' logits vs the fp32 reference")
    add_model_args(bq)
    bq.add_argument("--json", action="store_true")
    bq.add_argument("--text", default=str(DEFAULT_TEXT), help="text to teacher-force (default: the GPL-3)")
    bq.add_argument("--tokens", type=int, default=2000, help="tokens of the text to score")
    bq.add_argument(
        "--kv-types",
        default="fp16,bf16,q8",
        help="KV types scored against an fp32 cache with the same weights (comma-separated; empty: none)",
    )
    bq.set_defaults(handler=lambda args: run_quality_bench(args, settings_from(args)))
