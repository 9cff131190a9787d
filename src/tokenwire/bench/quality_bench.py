"""`tokenwire bench quality`: the quantised path's logits against the fp32 reference.

Both run the same GGUF: the reference dequantises it to fp32 (`--weights fp32`, read a layer at a
time as the pass runs, so a model whose fp32 copy outgrows memory is measured too); the candidate
keeps its blocks (`--weights gguf`, or what --weights names). The text is teacher-forced: every
position's logprob of the true next token and the top-1 token are compared, and (decode, and
llama.cpp) the KL divergence of the whole next-token distribution from the reference's (its
rows from one dense pass over the text, fp32 weights and activations). The candidate is
measured twice, because the two paths differ: prefill (512-token chunks) and decode (one token
per step through the fused decode kernel, as generation runs). Both with the engine's KV type
(--kv-dtype). Then each KV type of --kv-types against an fp32 cache, with the candidate's
weights: the cache's rounding alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenwire.bench import llamacpp_baseline
from tokenwire.bench.divergence import kl_divergence
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine, load_model
from tokenwire.engine.kv_cache import KVCache, as_stored, kv_bytes_per_token, resolve_kv_dtype
from tokenwire.engine.request import GenerateOptions, TokenEvent
from tokenwire.model import kernels
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.layers.decoder import PagedDecode

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # plain English prose on every Debian machine

# per position p >= 1: (logprob of token p, top-1 token id, KL(reference || this) of the
# distribution of token p; nan where not measured)
Scored = list[tuple[float, int, float]]


def score_prefill(engine: Engine, tokens: list[int]) -> Scored:
    opts = GenerateOptions(
        max_tokens=0, logprob_ranges=[(1, len(tokens))], top_logprobs=1, use_prefix_cache=False
    )
    events, _ = engine.generate(None, tokens, opts).result()
    return [(e.logprob, e.top_logprobs[0][0], math.nan) for e in events if isinstance(e, TokenEvent)]


def score_reference(engine: Engine, kv_dtype: str, tokens: list[int], rows_into: np.ndarray) -> Scored:
    """The reference pass: the engine's model in fp32 (a GGUF's blocks dequantised exactly, as
    `--weights fp32` loads them), the whole text through it at once (dense causal attention,
    keys and values rounded as a `kv_dtype` cache stores them), every position's log-softmax row
    kept in `rows_into` [positions, vocab] for the candidates' KL divergence. Its layers are read
    one at a time as they run (families.build_model's `stream_layers`): the fp32 copy of
    OLMoE-1B-7B (28 GB) does not fit a 24 GiB machine, one layer of it (1.6 GB) does."""
    assert engine.source is not None, "the reference is loaded from the engine's model files"
    model = load_model(engine.source, "fp32", engine.model.device, len(tokens), stream_layers=True)
    ids = torch.tensor(tokens[:-1])
    attention = DenseCausalAttention(1, len(ids), round_kv=functools.partial(as_stored, kv_dtype=kv_dtype))
    out: Scored = []
    with torch.inference_mode():
        hidden, _ = model(ids, torch.arange(len(ids)), attention)
        for start in range(0, len(ids), 256):
            logp = torch.log_softmax(model.logits(hidden[start : start + 256]).double(), -1).numpy()
            rows_into[start : start + len(logp)] = logp
            for i, row in enumerate(logp):
                out.append((float(row[tokens[start + i + 1]]), int(row.argmax()), math.nan))
    return out


def score_decode(engine: Engine, tokens: list[int], reference: np.ndarray | None = None) -> Scored:
    """One token per model step, as generation runs: each step is a PagedDecode batch of one row
    (the fused decode kernel when the model has it) over a KV cache of its own. `reference`:
    the reference's log-softmax rows [positions, vocab], for each position's KL divergence."""

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
                logp = torch.log_softmax(model.logits(hidden)[0].double(), -1).numpy()
                kl = math.nan if reference is None else kl_divergence(reference[p], logp)
                out.append((float(logp[tokens[p + 1]]), int(logp.argmax()), kl))
        return out

    return engine.call_on_model_thread(run).result()


def compare(reference: Scored, candidate: Scored) -> dict[str, float | None]:
    pairs = list(zip(reference, candidate, strict=True))
    diffs = [abs(r[0] - c[0]) for r, c in pairs]
    kls = [c[2] for c in candidate if not math.isnan(c[2])]
    return {
        "top1_agreement": sum(r[1] == c[1] for r, c in pairs) / len(pairs),
        "mean_abs_logprob_diff": statistics.fmean(diffs),
        "max_abs_logprob_diff": max(diffs),
        "mean_kl": statistics.fmean(kls) if kls else None,
        "perplexity": math.exp(-statistics.fmean(c[0] for c in candidate)),
    }


def paired(reference: Scored, ours: Scored, theirs: Scored) -> dict[str, dict[str, float]]:
    """Per position, ours' |Δlogprob| minus theirs' (and KL likewise): the mean and its standard
    error (the positions' spread over sqrt(n), as if independent; neighbouring positions are
    not quite, so it is if anything too small). A difference of the means within two standard
    errors is one this text cannot tell from chance."""
    out: dict[str, dict[str, float]] = {}
    abs_diffs = [abs(o[0] - r[0]) - abs(t[0] - r[0]) for r, o, t in zip(reference, ours, theirs, strict=True)]
    kls = [o[2] - t[2] for o, t in zip(ours, theirs, strict=True) if not math.isnan(o[2] + t[2])]
    for name, values in (("abs_logprob_diff", abs_diffs), ("kl", kls)):
        if len(values) > 1:
            stderr = statistics.stdev(values) / math.sqrt(len(values))
            out[name] = {"mean": statistics.fmean(values), "stderr": stderr}
    return out


def run_quality_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    with tempfile.TemporaryDirectory(prefix="tokenwire-quality-") as tmp:
        engine = build_engine(settings)
        kv_types = [kv for kv in args.kv_types.split(",") if kv]
        try:
            weights, kv_dtype = engine.weights, engine.kv.kv_dtype
            tokens = engine.tokenizer.encode(text)[: args.tokens]
            # the reference's log-softmax rows, on disk (positions x vocab float32: 0.4 GB for
            # 2,000 tokens of a 49k vocabulary), read by the candidate's pass and llama.cpp's
            # child process
            rows_path = Path(tmp) / "reference.npy"
            shape = (len(tokens) - 1, engine.model.config.vocab_size)
            rows = np.lib.format.open_memmap(rows_path, mode="w+", dtype=np.float32, shape=shape)
            # the reference's cache: fp32 unless --kv-dtype names one (auto is the fp32 model's)
            reference_kv = resolve_kv_dtype(settings.kv_dtype, torch.float32, quantized=False)
            reference = score_reference(engine, reference_kv, tokens, rows)
            rows.flush()
            peer = score_llamacpp(engine, tokens, rows_path)
            prefill = score_prefill(engine, tokens)
            decode = score_decode(engine, tokens, reference=rows)
            by_kv = score_kv_types(engine, tokens, kv_types) if kv_types else None
        finally:
            engine.shutdown()
        del rows
    result = {
        "weights": weights,
        "tokens": len(tokens),
        "reference_perplexity": math.exp(-statistics.fmean(r[0] for r in reference)),
        "prefill": compare(reference, prefill),
        "decode": compare(reference, decode),
        "kv_dtype": kv_dtype,
        "kernels": f"{kernels.kernel_path()} ({kernels.isa_choice()} build)",
    }
    if peer is not None:  # llama.cpp on the same file and text, against the same reference
        llamacpp, result["llamacpp_kernels"] = peer
        result["llamacpp"] = compare(reference, llamacpp)
        result["decode_minus_llamacpp"] = paired(reference, decode, llamacpp)
    if by_kv is not None:
        result["kv_vs_fp32_kv"] = by_kv
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokenwire bench quality — {engine.name}: {weights} vs fp32 (dequantised), {len(tokens)} tokens")
    columns = [("top-1 agree", 13), ("mean |dlogp|", 14), ("max |dlogp|", 13), ("mean KL", 11)]
    print(f"{'path':<10}" + "".join(f"{name:>{width}}" for name, width in columns) + f"{'perplexity':>12}")
    print(f"{'fp32 ref':<10}{'':>13}{'':>14}{'':>13}{'':>11}{result['reference_perplexity']:>12.3f}")
    for path in ("prefill", "decode", "llamacpp"):
        if path not in result:
            continue
        r = result[path]
        kl = "" if r["mean_kl"] is None else f"{r['mean_kl']:.2e}"
        print(
            f"{path:<10}{r['top1_agreement'] * 100:>12.2f}%{r['mean_abs_logprob_diff']:>14.2e}"
            f"{r['max_abs_logprob_diff']:>13.2e}{kl:>11}{r['perplexity']:>12.3f}"
        )
    if "decode_minus_llamacpp" in result:
        diffs = [
            f"{label} {d['mean']:+.2e} ± {d['stderr']:.1e}"
            for key, label in (("abs_logprob_diff", "|dlogp|"), ("kl", "KL"))
            if (d := result["decode_minus_llamacpp"].get(key)) is not None
        ]
        print("decode - llamacpp per position, mean ± standard error: " + ", ".join(diffs))
    print(f"text: {args.text}, teacher-forced; decode = one token per step through the fused kernel")
    print("reference: fp32 weights and activations, the text in one pass; KL(reference || path) per position")
    print(f"KV cache: {kv_dtype} in the rows above")
    peer_kernels = result.get("llamacpp_kernels")
    print(f"kernels: {result['kernels']}" + ("" if peer_kernels is None else f"; llama.cpp: {peer_kernels}"))
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


def llamacpp_peer(engine: Engine) -> llamacpp_baseline.LlamaCppProcess | None:
    """llama.cpp on the engine's file, where it is a GGUF and the `bench` extra is installed: its
    build for our kernels' instruction set (the AVX2-only one on the AVX2 stand-in, where
    `make bench-peer-avx2` installed it)."""
    gguf = engine.source.source if engine.source is not None else None
    if gguf is None or gguf.suffix.lower() != ".gguf" or not llamacpp_baseline.available():
        return None
    return llamacpp_baseline.LlamaCppProcess(gguf, torch.get_num_threads(), 1, 512, kernels.isa_choice())


def score_llamacpp(engine: Engine, tokens: list[int], reference_rows: Path) -> tuple[Scored, str] | None:
    """llama.cpp's own teacher-forced scores of the text (its f16 cache, 512-token batches) and
    the instruction set its build runs: the peer the quantised path is held to (issue 42: at
    least as faithful as llama.cpp on the same file)."""
    llama = llamacpp_peer(engine)
    if llama is None:
        return None
    try:
        return llama.teacher_forced(tokens, "f16", reference_rows), llama.kernels
    finally:
        llama.close()


def score_kv_types(engine: Engine, tokens: list[int], kv_types: list[str]) -> dict[str, Any]:
    """The text prefilled with the engine's weights and each KV type, against an fp32 cache:
    every position's attention reads the keys and values as the cache stores them. With fp32
    activations, so the rows show the cache's rounding alone: with int8 ones a cache's last bits
    move activations across their rounding steps, and those flips (up to 0.22 in a logprob on
    the shipped SmolLM2, fp16 against fp32 cache) would be counted as the cache's."""
    mb = 2 * len(tokens) * kv_bytes_per_token(engine.model.config, "fp32") / 2**20

    def scored(kv: str) -> Scored:
        other = Engine(engine.model, engine.tokenizer, name=engine.name, kv_cache_mb=mb, kv_dtype=kv)
        kernels.ops().set_int16_activations(False)
        try:
            return score_prefill(other, tokens)
        finally:
            kernels.ops().set_int16_activations(True)
            other.shutdown()

    reference = scored("fp32")
    out: dict[str, Any] = {"fp32_kv_perplexity": math.exp(-statistics.fmean(r[0] for r in reference))}
    for kv in kv_types:
        out[kv] = compare(reference, scored(kv))
    llama = llamacpp_peer(engine)
    if llama is not None:  # llama.cpp's own q8_0 cache against its f16 one, the same measures
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
