"""`tokenwire bench engine`: our engine against transformers' generate(), in one run.

Same model directory, same prompts, same machine, measured side by side:
- single_stream: greedy decode tok/s of one stream (decode only: the first token's time,
  which includes the prefill, is excluded on both sides);
- streams_32: aggregate tok/s of N concurrent streams, wall clock including prefill
  (transformers gets them as one left-padded batch, its best case);
- turn2_ttft: time to the first token of a second turn on a long session, reusing the
  session's KV against re-prefilling the whole conversation (prefix cache off).
Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent

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


def _greedy(n: int, use_prefix_cache: bool = True) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        use_prefix_cache=use_prefix_cache,
    )


def ours_single(engine: Engine, prompt: list[int], n: int) -> float:
    stamps = []
    for event in engine.generate(None, prompt, _greedy(n, use_prefix_cache=False)):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_streams(engine: Engine, prompts: list[list[int]], n: int) -> float:
    start = time.perf_counter()
    handles = [engine.generate(None, p, _greedy(n, use_prefix_cache=False)) for p in prompts]
    total = sum(len(h.result()[0]) for h in handles)
    return total / (time.perf_counter() - start)


def ours_turn2(engine: Engine, session_tokens: int, reuse: bool) -> float:
    tok = engine.tokenizer
    filler = tok.encode(" ".join(f"The number {i} is followed by {i + 1}." for i in range(400)))
    turn1 = filler[:session_tokens]
    turn2 = tok.encode(" Now, what comes after 7?")
    if reuse:
        sid = engine.create_session()
        engine.generate(sid, turn1, _greedy(0)).result()
        start = time.perf_counter()
        handle = engine.generate(sid, turn2, _greedy(1))
    else:
        sid = None
        start = time.perf_counter()
        handle = engine.generate(None, turn1 + turn2, _greedy(1, use_prefix_cache=False))
    for event in handle:
        if isinstance(event, TokenEvent):
            elapsed = time.perf_counter() - start
            break
    handle.result()  # drain the rest (the finish event)
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


def run_engine_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    engine = build_engine(settings)
    n, reps = args.decode_tokens, args.repeats
    try:
        prompts = _prompts(engine, args.streams)
        model_dir = str(engine.source.model_dir)
        ours_single(engine, prompts[0], 8)  # warm-up
        single = _median(lambda: ours_single(engine, prompts[0], n), reps)
        streams = _median(lambda: ours_streams(engine, prompts, n), reps)
        turn2 = (
            _median(lambda: ours_turn2(engine, args.session_tokens, True), reps),
            _median(lambda: ours_turn2(engine, args.session_tokens, False), reps),
        )
        # the engine idles (its threads asleep) while the baseline runs in its own process
        hf = hf_baseline(model_dir, prompts, n, reps, ftz=False)
        hf_ftz = hf_baseline(model_dir, prompts, n, reps, ftz=True) if args.ftz_baseline else None
    finally:
        engine.shutdown()
    key = f"streams_{args.streams}"
    result: dict[str, dict[str, float]] = {
        "single_stream": {
            "tokenwire_tok_s": single,
            "hf_tok_s": hf["single_decode_tok_s"],
            "ratio": single / hf["single_decode_tok_s"],
        },
        key: {
            "tokenwire_tok_s": streams,
            "hf_tok_s": hf["streams_tok_s"],
            "ratio": streams / hf["streams_tok_s"],
        },
        "turn2_ttft": {"reuse_s": turn2[0], "reprefill_s": turn2[1], "ratio": turn2[1] / turn2[0]},
    }
    if hf_ftz is not None:
        result["single_stream"]["hf_flush_denormal_tok_s"] = hf_ftz["single_decode_tok_s"]
        result[key]["hf_flush_denormal_tok_s"] = hf_ftz["streams_tok_s"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    threads = torch.get_num_threads()
    print(f"tokenwire bench engine — {engine.name}, {settings.dtype}, {threads} threads, median of {reps}")
    print(f"{'measure':<26}{'tokenwire':>14}{'baseline':>14}{'ratio':>9}")
    for label, row in (
        ("single-stream decode", result["single_stream"]),
        (f"{args.streams} streams aggregate", result[key]),
    ):
        print(
            f"{label:<26}{row['tokenwire_tok_s']:>10.1f} t/s{row['hf_tok_s']:>10.1f} t/s{row['ratio']:>8.2f}x"
        )
    t = result["turn2_ttft"]
    print(
        f"{'turn-2 TTFT (reuse/re-pf)':<26}{t['reuse_s'] * 1000:>11.1f} ms{t['reprefill_s'] * 1000:>11.1f} ms"
        f"{t['ratio']:>8.2f}x"
    )
    print("baseline: stock transformers generate() in its own process (decode rows); re-prefill of the whole")
    print("session, prefix cache off (TTFT row)")
    if hf_ftz is not None:
        print(
            f"transformers with denormals flushed: {hf_ftz['single_decode_tok_s']:.1f} t/s single, "
            f"{hf_ftz['streams_tok_s']:.1f} t/s at {args.streams} streams"
        )
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tokenwire.cli import add_model_args, settings_from

    be = bench_sub.add_parser("engine", help="engine vs transformers generate()")
    add_model_args(be)
    be.add_argument("--json", action="store_true")
    be.add_argument("--decode-tokens", type=int, default=64)
    be.add_argument("--streams", type=int, default=32)
    be.add_argument("--session-tokens", type=int, default=1000)
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument(
        "--ftz-baseline", action="store_true", help="also run transformers with denormals flushed"
    )
    be.set_defaults(handler=lambda args: run_engine_bench(args, settings_from(args)))
