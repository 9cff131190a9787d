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
import statistics
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
        out.append(tok.apply_chat_template([{"role": "user", "content": q}]) if tok.has_chat_template else tok.encode(q))
    return out


def _greedy(n: int, use_prefix_cache: bool = True) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True, use_prefix_cache=use_prefix_cache
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


def hf_single(model: torch.nn.Module, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])

    def timed(tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    t1, tn = timed(1), timed(n)
    return (n - 1) / (tn - t1)


def hf_streams(model: torch.nn.Module, prompts: list[list[int]], n: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return (out.shape[0] * (out.shape[1] - width)) / (time.perf_counter() - start)


def run_engine_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    from transformers import AutoModelForCausalLM

    from tokenwire.model.loader import resolve_model

    settings.progress = False
    engine = build_engine(settings)
    source = resolve_model(settings.model, cache_dir=settings.cache_dir, name=settings.model_name, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(source.model_dir, dtype=torch.float32).eval()
    try:
        prompts = _prompts(engine, args.streams)
        n, reps = args.decode_tokens, args.repeats
        with torch.inference_mode():
            ours_single(engine, prompts[0], 8)  # warm-up both sides
            hf_single(hf, prompts[0], 4)
            single = (_median(lambda: ours_single(engine, prompts[0], n), reps),
                      _median(lambda: hf_single(hf, prompts[0], n), reps))
            streams = (_median(lambda: ours_streams(engine, prompts, n), reps),
                       _median(lambda: hf_streams(hf, prompts, n), reps))
            turn2 = (_median(lambda: ours_turn2(engine, args.session_tokens, True), reps),
                     _median(lambda: ours_turn2(engine, args.session_tokens, False), reps))
    finally:
        engine.shutdown()
    result = {
        "single_stream": {"tokenwire_tok_s": single[0], "hf_tok_s": single[1], "ratio": single[0] / single[1]},
        f"streams_{args.streams}" if args.streams != 32 else "streams_32": {
            "tokenwire_tok_s": streams[0], "hf_tok_s": streams[1], "ratio": streams[0] / streams[1]},
        "turn2_ttft": {"reuse_s": turn2[0], "reprefill_s": turn2[1], "ratio": turn2[1] / turn2[0]},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokenwire bench engine — model {engine.name}, {settings.dtype}, {torch.get_num_threads()} threads, "
          f"median of {reps}")
    print(f"{'measure':<26}{'tokenwire':>14}{'baseline':>14}{'ratio':>9}")
    s, m, t = result["single_stream"], next(iter(v for k, v in result.items() if k.startswith("streams"))), turn2
    print(f"{'single-stream decode':<26}{s['tokenwire_tok_s']:>10.1f} t/s{s['hf_tok_s']:>10.1f} t/s{s['ratio']:>8.2f}x")
    print(f"{f'{args.streams} streams aggregate':<26}{m['tokenwire_tok_s']:>10.1f} t/s{m['hf_tok_s']:>10.1f} t/s"
          f"{m['ratio']:>8.2f}x")
    print(f"{'turn-2 TTFT (reuse/re-pf)':<26}{t[0] * 1000:>11.1f} ms{t[1] * 1000:>11.1f} ms{t[1] / t[0]:>8.2f}x")
    print("baseline: transformers generate() for decode rows; re-prefill of the whole session for TTFT")
    return 0
