"""`tokenwire bench spec --lock-hold`: how long the model thread holds the engine lock per step
(engine/lock_holds.py) at N concurrent greedy streams, for the engine as the flags build it:
`--speculate draft --draft-model PATH` for a draft model's guesses, `--speculate ngram|off`.

While the model thread holds the lock, every API call waits (a new request, a cancel, stats);
a draft model's guesses made under it (one draft request at a time, each awaited) held it for
whole draft steps. Reported: median and p99 of each step's holds (schedule: admission, packing
and guesses; postprocess: sampling and events; total), tok/s, and the draft's steps per step.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from tokenwire.bench.edit_prompts import edit_prompt
from tokenwire.bench.measures import ours_streams
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine


def stream_prompt(engine: Engine, variant: int, functions: int) -> list[int]:
    """An edit request (spec_bench's) over a shorter file: 32 of them prefill in seconds."""
    return edit_prompt(engine, variant, functions)


def run_lock_hold(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    engine = build_engine(settings)
    try:
        prompts = [stream_prompt(engine, i, args.functions) for i in range(args.streams)]
        ours_streams(engine, prompts[:2], 8)  # warm-up (the kernels' first calls, both engines)
        engine.lock_holds.clear()
        steps = engine.stats()["steps"]
        draft_steps = engine.draft.stats()["steps"] if engine.draft is not None else 0
        started = time.perf_counter()
        tok_s = ours_streams(engine, prompts, args.edit_tokens)
        wall = time.perf_counter() - started
        stats = engine.stats()
        steps = stats["steps"] - steps
        if engine.draft is not None:
            draft_steps = engine.draft.stats()["steps"] - draft_steps
        result: dict[str, Any] = {
            "streams": args.streams,
            "new_tokens": args.edit_tokens,
            "prompt_tokens": len(prompts[0]),
            "speculate": engine.speculate,
            "tok_s": tok_s,
            "wall_s": wall,
            "steps": steps,
            "draft_steps_per_step": draft_steps / steps if steps else 0.0,
            "spec_acceptance": stats["spec_accepted"] / stats["spec_proposed"]
            if stats["spec_proposed"]
            else 0.0,
            **{f"lock_{k}": v for k, v in engine.lock_holds.summary().items()},
        }
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    r = result
    print(
        f"tokenwire bench spec --lock-hold — {r['streams']} streams x {r['new_tokens']} tokens "
        f"(prompts of {r['prompt_tokens']}), --speculate {r['speculate']}, {torch.get_num_threads()} threads"
    )
    print(f"{'engine lock held per step (ms)':<32}{'median':>11}{'p99':>11}")
    for part in ("schedule", "postprocess", "total"):
        median, p99 = r.get(f"lock_{part}_median_ms", 0.0), r.get(f"lock_{part}_p99_ms", 0.0)
        print(f"  {part:<30}{median:>11.3f}{p99:>11.3f}")
    print(
        f"{int(r['lock_steps'])} steps, {r['tok_s']:.1f} tok/s, {r['wall_s']:.1f} s; "
        f"draft steps per step {r['draft_steps_per_step']:.2f}, acceptance {r['spec_acceptance'] * 100:.0f}%"
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-hold",
        action="store_true",
        help="only the engine lock's hold time per step at --streams streams (median, p99)",
    )
    parser.add_argument(
        "--functions", type=int, default=4, help="--lock-hold: functions in the prompt's file"
    )
