"""`tokenwire bench engine`: our engine against llama.cpp and transformers, in one run.

Same model directory, same prompts, same machine, measured side by side:
- single_stream: greedy decode tok/s of one stream (decode only: the first token's time,
  which includes the prefill, is excluded on both sides);
- streams_32: aggregate tok/s of N concurrent streams, wall clock including prefill
  (transformers gets them as one left-padded batch, its best case);
  both decode measures run one token a step on our side too (the requests' `speculate` off), as
  llama.cpp's and transformers' do: a random-weight model's greedy text loops, and prompt lookup
  (engine/speculation.py) then keeps guesses a real text would not earn. Measured on the
  gemma3-1b Q4_K_M shape (AVX-512 Zen 5, 64 tokens): 43-64 tok/s from 23-34 steps/s with
  lookup, 32 tok/s without, which had read as 62 GB/s of weights (`tokenwire bench spec` measures
  speculation on real text);
- prefill_1k: prompt tokens/s of a 1,000-token prompt until its first generated token
  (`--prefill-tokens N`: prefill_N);
- turn2_ttft: time to the first token of a second turn on a long session, reusing the
  session's KV against re-prefilling the whole conversation (prefix cache off);
- decode_at_4k, decode_at_8k: single-stream decode after a long context, per KV type, beside
  llama.cpp's matching cache, in-process and served through the OpenAI API, with the KV GB/s
  each decode step reads (bench/long_context.py), and kv_bytes_per_token.
Beside each speed, the weight bandwidth it implies (weight_gb_s, GB = 1e9 bytes): the bytes of
weight matrices one forward step reads (shapes.weight_bytes, from the GGUF's own tensor sizes, the
same figure for both engines) times forward steps per second: tok/s for a single stream, tok/s
over the streams for N streams (a step advances each by one; the wall clock includes their
prefill), prompts/s times the prompt's batches for the prefill (both engines take 512 tokens a
step). And the load: our build_engine's seconds (load_s: a cold start when the file's conversion
ran, load_cold), llama.cpp's model and contexts (llamacpp_load_s; it maps the file, which the
first steps read), and a warm load again in a fresh process for its peak RSS (load_probe.py).
llama.cpp runs the very GGUF through llama-cpp-python (the `bench` extra) in this process,
interleaved round by round with ours; transformers runs the converted fp32 weights in a process
of its own. Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tokenwire.bench import llamacpp_baseline, load_probe
from tokenwire.bench.long_context import print_long_context, run_long_context
from tokenwire.bench.measures import greedy, ours_single, ours_streams
from tokenwire.bench.neighbours import busy_neighbours, describe
from tokenwire.bench.quality_bench import add_quality_parser
from tokenwire.bench.shapes import (
    LLAMA_CPP_QUANTS,
    QUANTS,
    SHAPES,
    check,
    shape_file,
    shape_path,
    weight_bytes,
)
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import TokenEvent, iter_events
from tokenwire.heap import freeze_startup_heap
from tokenwire.model.kernels import isa_choice, kernel_path
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.loader import cache_key, default_cache_dir, default_model_path
from tokenwire.model.quant import resident_bytes

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
]


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + (f" (variant {i})" if i >= len(QUESTIONS) else "")
        out.append(
            tok.apply_chat_template([{"role": "user", "content": q}])
            if tok.has_chat_template
            else tok.encode(q)
        )
    return out


def ours_turn2(engine: Engine, session_tokens: int, reuse: bool) -> float:
    tok = engine.tokenizer
    filler = tok.encode(" ".join(f"The number {i} is followed by {i + 1}." for i in range(400)))
    turn1 = filler[:session_tokens]
    turn2 = tok.encode(" Now, what comes after 7?")
    if reuse:
        sid = engine.create_session()
        engine.generate(sid, turn1, greedy(0)).result()
        start = time.perf_counter()
        handle = engine.generate(sid, turn2, greedy(1))
    else:
        sid = None
        start = time.perf_counter()
        handle = engine.generate(None, turn1 + turn2, greedy(1, use_prefix_cache=False))
    events = iter_events(handle)
    for event in events:
        if isinstance(event, TokenEvent):
            elapsed = time.perf_counter() - start
            break
    for _ in events:  # drain the rest (the finish event)
        pass
    if sid is not None:
        engine.close_session(sid)
    return elapsed


def hf_baseline(
    model_dir: str, prompts: list[list[int]], n: int, repeats: int, ftz: bool
) -> dict[str, float]:
    """Stock transformers generate(), in a process of its own (see hf_baseline.py)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        cmd = [sys.executable, "-m", "tokenwire.bench.hf_baseline", model_dir, f.name, str(n), str(repeats)]
        out = subprocess.run(cmd + (["ftz"] if ftz else []), capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours_prefill(engine: Engine, prompt: list[int]) -> float:
    """Prompt tokens per second until the first generated token (prefix cache off)."""
    start = time.perf_counter()
    engine.generate(None, prompt, greedy(1, use_prefix_cache=False)).result()
    return len(prompt) / (time.perf_counter() - start)


def long_prompt(engine: Engine, n: int) -> list[int]:
    tok = engine.tokenizer
    text = " ".join(
        f"Line {i}: the river passes mill number {i * 7 % 97} before the bridge." for i in range(n)
    )
    return tok.encode(text)[:n]


def _converted(model: str | None, cache_dir: Path) -> bool | None:
    """Whether the GGUF's first-start conversion is cached already (None: not a GGUF file)."""
    path = Path(model) if model is not None else default_model_path()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    return (cache_dir / cache_key(path) / "tokenwire_source.json").is_file()


def prefill_key(tokens: int) -> str:
    """The prefill measure's name: prefill_1k for the default 1,000 tokens, else prefill_<n>
    (prefill_4096 for --prefill-tokens 4096), so a result never names a length it did not run."""
    return "prefill_1k" if tokens == 1000 else f"prefill_{tokens}"


def steps_per_s(measure: str, tok_s: float, streams: int, prompt: int, batch: int) -> float:
    """Forward steps per second behind a measure's tok/s (see the module's docstring)."""
    if measure == "single_stream":
        return tok_s
    if measure.startswith("prefill_"):
        return tok_s / prompt * math.ceil(prompt / batch)
    return tok_s / streams


def run_engine_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    cache_dir = settings.cache_dir or default_cache_dir()
    shape = quant = written_s = None
    if args.shape:  # a random-weight file at a real model's widths (bench/shapes.py)
        if args.model:
            raise SystemExit("--shape and --model: give one (--shape writes its own model file)")
        shape, quant = args.shape, args.quant or "Q4_0"
        check(shape, quant)  # one line for an unknown name, before anything is written
        existed = shape_path(shape, quant, cache_dir).exists()
        started = time.perf_counter()
        settings.model = str(shape_file(shape, quant, cache_dir))
        written_s = None if existed else time.perf_counter() - started
    elif args.quant:
        raise SystemExit("--quant goes with --shape (a --model file has its own types)")
    converted = _converted(settings.model, cache_dir)
    started = time.perf_counter()
    engine = build_engine(settings)
    load_s = time.perf_counter() - started
    n, reps = args.decode_tokens, args.repeats
    key, prefill = f"streams_{args.streams}", prefill_key(args.prefill_tokens)
    ours: dict[str, list[float]] = {"single_stream": [], key: [], prefill: []}
    peer: dict[str, list[float]] = {name: [] for name in ours}
    ours_loaded: dict[str, list[float]] = {name: [] for name in ours}
    peer_loaded: dict[str, list[float]] = {name: [] for name in ours}
    gguf = engine.source.source if engine.source.source.suffix.lower() == ".gguf" else None
    llama = None
    if args.llamacpp and gguf is not None and llamacpp_baseline.available():
        llama = llamacpp_baseline.LlamaCppProcess(
            gguf, torch.get_num_threads(), args.streams, 512, our_isa=isa_choice()
        )
    llamacpp_load_s = llama.load_s if llama is not None else None
    llamacpp_kernels = llama.kernels if llama is not None else None
    try:
        prompts = _prompts(engine, args.streams)
        long = long_prompt(engine, args.prefill_tokens)
        model_dir, name = str(engine.source.model_dir), engine.name
        resident_mb = engine.call_on_model_thread(partial(resident_bytes, engine.model)).result() / 2**20
        freeze_startup_heap()  # as `serve` does after start-up (heap.py: a full GC costs ~170 ms)
        ours_single(engine, prompts[0], 8, speculate=False)  # warm-up
        if llama is not None:
            llama.single_decode(prompts[0], 8)
        # interleaved rounds: each measure runs ours then llama.cpp, so both see the same machine;
        # with --neighbours, each round runs every measure quiet and then beside the busy loops
        conditions = [0, args.neighbours] if args.neighbours else [0]
        for _ in range(reps):
            for busy in conditions:
                mine, theirs = (ours, peer) if busy == 0 else (ours_loaded, peer_loaded)
                with busy_neighbours(busy, own_session=not args.neighbours_same_session):
                    mine["single_stream"].append(ours_single(engine, prompts[0], n, speculate=False))
                    mine[key].append(ours_streams(engine, prompts, n, speculate=False))
                    mine[prefill].append(ours_prefill(engine, long))
                    if llama is not None:
                        theirs["single_stream"].append(llama.single_decode(prompts[0], n))
                        theirs[key].append(llama.streams(prompts, n))
                        theirs[prefill].append(llama.prefill(long))
        turn2 = (
            _median(partial(ours_turn2, engine, args.session_tokens, True), reps),
            _median(partial(ours_turn2, engine, args.session_tokens, False), reps),
        )
        long_kv = [kv for kv in args.long_kv.split(",") if kv]
        long_ctx = (
            run_long_context(engine, llama, long_kv, n, reps, served=args.long_served) if long_kv else None
        )
        # the engine idles (its threads asleep) while the baseline runs in its own process
        hf = hf_baseline(model_dir, prompts, n, reps, ftz=False) if args.hf else None
        weights, decode, kv_mb = engine.weights, decode_path(engine.model), engine.kv_cache_mb
        kv_dtype = engine.kv.kv_dtype
    finally:
        if llama is not None:
            llama.close()
        engine.shutdown()
    # the probe's process loads the model again: this one's weights are freed first
    gc.unfreeze()
    del engine
    gc.collect()
    # the KV cache this engine chose (its default depends on the RAM free at the time)
    probe = load_probe.probe(replace(settings, kv_cache_mb=kv_mb)) if args.load_probe else None
    result: dict[str, Any] = {"shape": shape, "quant": quant}
    step_bytes = weight_bytes(gguf) if gguf is not None else None
    hf_keys = {"single_stream": "single_decode_tok_s", key: "streams_tok_s"}
    for measure, runs in ours.items():
        # each round's figures too: on a shared VM the rounds of one measure can differ by half,
        # and two medians alone hid that (docs/engine.md, the AVX2-only EPYC's table)
        row: dict[str, Any] = {"tokenwire_tok_s": statistics.median(runs), "tokenwire_rounds_tok_s": runs}
        if hf is not None and measure in hf_keys:
            row["hf_tok_s"] = hf[hf_keys[measure]]
            row["ratio"] = row["tokenwire_tok_s"] / row["hf_tok_s"]
        if peer[measure]:
            row["llamacpp_tok_s"] = statistics.median(peer[measure])
            row["ratio_vs_llamacpp"] = row["tokenwire_tok_s"] / row["llamacpp_tok_s"]
            row["llamacpp_rounds_tok_s"] = peer[measure]
            row["rounds_ratio_vs_llamacpp"] = [o / t for o, t in zip(runs, peer[measure], strict=True)]
        for engine_key, loaded in (("tokenwire", ours_loaded), ("llamacpp", peer_loaded)):
            if loaded[measure]:  # speed beside the neighbours, and kept against the quiet runs
                row[f"{engine_key}_loaded_tok_s"] = statistics.median(loaded[measure])
                row[f"{engine_key}_kept"] = row[f"{engine_key}_loaded_tok_s"] / row[f"{engine_key}_tok_s"]
        for engine_key, batch in (("tokenwire", settings.max_batch_tokens), ("llamacpp", 512)):
            if step_bytes is not None and f"{engine_key}_tok_s" in row:
                steps = steps_per_s(measure, row[f"{engine_key}_tok_s"], args.streams, len(long), batch)
                row[f"{engine_key}_weight_gb_s"] = step_bytes * steps / 1e9
        result[measure] = row
    result["turn2_ttft"] = {"reuse_s": turn2[0], "reprefill_s": turn2[1], "ratio": turn2[1] / turn2[0]}
    if long_ctx is not None:
        result.update(long_ctx)
    result["kv_dtype"] = kv_dtype
    result["weights"] = weights
    result["decode"] = decode
    result["kernels"] = kernel_path()
    if args.neighbours:
        result["neighbours"] = describe(args.neighbours, own_session=not args.neighbours_same_session)
    result["resident_weight_mb"] = resident_mb
    result["gguf_mb"] = gguf.stat().st_size / 2**20 if gguf is not None else None
    result["gguf_written_s"] = written_s  # this run wrote the --shape file (else null)
    result["weight_mb_per_step"] = step_bytes / 2**20 if step_bytes is not None else None
    result["load_s"] = load_s
    result["load_cold"] = None if converted is None else not converted
    result["llamacpp_load_s"] = llamacpp_load_s
    result["llamacpp_kernels"] = llamacpp_kernels
    result["kv_cache_mb"] = kv_mb
    if probe is not None:
        result["load_warm_s"] = probe["load_s"]
        result["load_peak_rss_mb"] = probe["peak_rss_mb"]
        result["load_rss_before_mb"] = probe["rss_before_mb"]
        # the issue's target: peak RSS <= file + KV cache + 300 MB
        result["load_rss_target_mb"] = (result["gguf_mb"] or 0) + probe["kv_cache_mb"] + 300
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_table(result, name, args, reps, llama_missing=gguf is not None and llama is None)
    if long_ctx is not None:
        print_long_context(result, long_kv)
    return 0


def decode_path(model: torch.nn.Module) -> str:
    """Which path decode steps take: the fused kernel, or eager and why (a layer kind the kernel
    does not know, or fusion turned off)."""
    if not isinstance(model, DecoderModel):
        return f"eager ({type(model).__name__})"
    if model.can_fuse_decode:
        return "fused (kernels/decode_stack.h)"
    return f"eager: {model.fusion_blocker or 'fusion turned off (--no-compile)'}"


def _print_table(
    result: dict[str, Any], name: str, args: argparse.Namespace, reps: int, llama_missing: bool
) -> None:
    threads = torch.get_num_threads()
    print(
        f"tokenwire bench engine — {name}, weights {result['weights']}, {threads} threads, median of {reps}"
    )
    print(f"decode steps: {result['decode']}; kernels: {result['kernels']} ({isa_choice()} build)")
    if result["llamacpp_kernels"] is not None:
        print(f"llama.cpp kernels: {result['llamacpp_kernels']}")
        if isa_choice() == "avx2" and result["llamacpp_kernels"] == "AVX-512":
            print("  (not like for like: an AVX2-only CPU has no AVX-512 llama.cpp; `make bench-peer-avx2`")
            print("  installs the AVX2-only build, which the AVX2 stand-in then measures against)")
    print(f"{'measure':<24}{'tokenwire':>12}{'llama.cpp':>12}{'ratio':>8}{'transformers':>14}{'ratio':>8}")

    def cell(row: dict[str, float], value: str, ratio: str) -> str:
        if value not in row:
            return f"{'-':>12}{'-':>8}"
        return f"{row[value]:>8.1f} t/s{row[ratio]:>7.2f}x"

    labels = {
        "single_stream": "single-stream decode",
        f"streams_{args.streams}": f"{args.streams} streams aggregate",
        prefill_key(args.prefill_tokens): f"prefill {args.prefill_tokens} tokens",
    }
    for measure, label in labels.items():
        row = result[measure]
        hf = cell(row, "hf_tok_s", "ratio")
        peer = cell(row, "llamacpp_tok_s", "ratio_vs_llamacpp")
        ratios = row.get("rounds_ratio_vs_llamacpp", [])
        spread = f"  rounds {min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else ""
        print(f"{label:<24}{row['tokenwire_tok_s']:>8.1f} t/s{peer}  {hf}{spread}")
    if "neighbours" in result:
        _print_kept(result, labels)
    t = result["turn2_ttft"]
    print(
        f"{'turn-2 TTFT reuse/re-pf':<24}{t['reuse_s'] * 1000:>9.1f} ms{t['reprefill_s'] * 1000:>9.1f} ms"
        f"{t['ratio']:>7.2f}x"
    )
    file_mb = result.get("gguf_mb")
    ratio = f" ({result['resident_weight_mb'] / file_mb:.2f}x the {file_mb:.1f} MiB GGUF)" if file_mb else ""
    print(f"resident weights: {result['resident_weight_mb']:.1f} MiB{ratio}")
    _print_file_and_load(result, labels)
    print("baselines: llama.cpp (llama-cpp-python, own process, same GGUF, token ids, threads; interleaved);")
    print("transformers generate() on the converted fp32 weights in its own process; turn-2 row: re-prefill")
    print("of the whole session with the prefix cache off")
    if llama_missing:
        print("llama.cpp baseline not run: install the bench extra (`make bench`, or pip install '.[bench]')")


def _print_file_and_load(result: dict[str, Any], labels: dict[str, str]) -> None:
    if result["shape"] is not None:
        written = result["gguf_written_s"]
        note = f", written in {written:.1f}s" if written is not None else ", written before"
        print(f"file: random weights at {result['shape']}'s widths, {result['quant']}{note}")
    if result["weight_mb_per_step"] is not None:
        print(f"{'weight GB/s':<24}{'tokenwire':>12}{'llama.cpp':>12}   "
              f"({result['weight_mb_per_step']:.1f} MiB of matrices a forward step)")  # fmt: skip
        for measure, label in labels.items():
            row = result[measure]
            cells = "".join(
                f"{row[k]:>9.1f} GB/s" if k in row else f"{'-':>12}"
                for k in ("tokenwire_weight_gb_s", "llamacpp_weight_gb_s")
            )
            print(f"{label:<24}{cells}")
    cold = {True: " (first start: converted the GGUF)", False: " (conversion cached)", None: ""}
    cold = cold[result["load_cold"]]
    load = f"load: tokenwire {result['load_s']:.1f}s{cold}"
    if "load_warm_s" in result:
        load += f", {result['load_warm_s']:.1f}s warm in a fresh process"
    if result["llamacpp_load_s"] is not None:
        load += f"; llama.cpp {result['llamacpp_load_s']:.2f}s (mmap: its first steps read the file)"
    print(load)
    if "load_peak_rss_mb" in result:
        peak, target = result["load_peak_rss_mb"], result["load_rss_target_mb"]
        print(
            f"load peak RSS {peak:.0f} MiB (fresh process; {result['load_rss_before_mb']:.0f} MiB before the "
            f"load) against file + KV {result['kv_cache_mb']:.0f} MiB + 300 = {target:.0f} MiB: "
            + ("within" if peak <= target else f"{peak - target:.0f} MiB over")
        )


def _print_kept(result: dict[str, Any], labels: dict[str, str]) -> None:
    print(f"beside {result['neighbours']} (quiet and loaded measured in the same rounds):")
    print(
        f"{'measure':<24}{'tokenwire':>12}{'loaded':>12}{'kept':>7}{'llama.cpp':>12}{'loaded':>12}{'kept':>7}"
    )

    def cells(row: dict[str, float], key: str) -> str:
        if f"{key}_kept" not in row:
            return f"{'-':>12}{'-':>12}{'-':>7}"
        quiet, loaded = row[f"{key}_tok_s"], row[f"{key}_loaded_tok_s"]
        return f"{quiet:>8.1f} t/s{loaded:>8.1f} t/s{row[f'{key}_kept']:>6.2f}x"

    for measure, label in labels.items():
        row = result[measure]
        print(f"{label:<24}{cells(row, 'tokenwire')}{cells(row, 'llamacpp')}")


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    be = bench_sub.add_parser("engine", help="engine vs llama.cpp on the same GGUF and transformers")
    add_model_args(be)
    be.add_argument("--json", action="store_true")
    be.add_argument("--decode-tokens", type=int, default=128, help="new tokens per stream")
    be.add_argument("--streams", type=int, default=32)
    be.add_argument("--session-tokens", type=int, default=1000)
    be.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians reported)")
    be.add_argument("--prefill-tokens", type=int, default=1000, help="prompt length of the prefill measure")
    be.add_argument(
        "--long-kv",
        default="fp16,q8",
        help="KV types of decode_at_4k / decode_at_8k (bench/long_context.py), comma-separated; "
        "empty skips them",
    )
    be.add_argument(
        "--no-long-served",
        dest="long_served",
        action="store_false",
        help="skip the long measures' served variant (the same request through the OpenAI API)",
    )
    be.add_argument(
        "--shape",
        help="bench a random-weight GGUF at a real model's widths instead of --model: "
        f"{', '.join(SHAPES)} (written once into the cache, bench/shapes.py)",
    )
    be.add_argument(
        "--quant",
        help=f"the --shape file's weight type (default Q4_0): {', '.join(QUANTS)}; "
        f"{', '.join(LLAMA_CPP_QUANTS)} by llama.cpp's own quantiser (the bench extra)",
    )
    be.add_argument(
        "--no-load-probe",
        dest="load_probe",
        action="store_false",
        help="skip the second, warm load in a fresh process that measures its peak RSS",
    )
    be.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="also run every measure beside N nice-19 busy loops (bench/neighbours.py): speed kept",
    )
    be.add_argument(
        "--neighbours-same-session",
        action="store_true",
        help="start the busy loops in this session (with autogroup scheduling: nearly idle priority to us)",
    )
    be.add_argument(
        "--no-llamacpp", dest="llamacpp", action="store_false", help="skip the llama.cpp baseline"
    )
    be.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    be.add_argument(
        "--ftz-baseline", action="store_true", help="also run transformers with denormals flushed"
    )
    be.set_defaults(handler=lambda args: run_engine_bench(args, settings_from(args)))

    add_quality_parser(bench_sub, add_model_args, settings_from)
