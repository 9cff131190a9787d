"""`tokenwire bench spec`: prompt-lookup speculation (engine/speculation.py) on three workloads,
each with our speculation off and on, and llama.cpp on the same GGUF with and without its own
prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding, 10 tokens a guess), in
interleaved rounds:

- edit: a ~600-token Python file in the prompt and an instruction to reproduce it with one
  rename (greedy, 400 new tokens): the answer copies its context;
- chat: free-form answers to short questions (greedy, 128 new tokens each): little to copy, so
  the adaptive switch must keep speculation from costing anything;
- streams: 32 edit requests at once (a verification's rows batch with the other decodes);
  llama.cpp's batched decode has no prompt lookup, so its row is without.

Single-stream speeds exclude the first token (whose time holds the prefill); 32 streams is
wall clock with the prefill. Beside the speeds: acceptance (kept guesses / guesses), the mean
kept guesses per verification, and forward steps per generated token, from the engine's
counters (stats(); the same as /metrics).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from tokenwire.bench import llamacpp_baseline, lock_hold_bench
from tokenwire.bench.edit_prompts import edit_prompt
from tokenwire.bench.engine_bench import QUESTIONS
from tokenwire.bench.measures import ours_single, ours_streams
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.model.kernels import isa_choice


class Counted:
    """The engine's speculation counters over the runs of one workload."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.totals = dict.fromkeys(("proposed", "accepted", "verifications", "tokens", "steps"), 0)

    def __call__(self, fn: Any, *args: Any) -> float:
        before = self.engine.stats()
        speed = fn(self.engine, *args)
        after = self.engine.stats()
        for key, stat in (("proposed", "spec_proposed"), ("accepted", "spec_accepted"),
                          ("verifications", "spec_verifications"), ("steps", "steps")):  # fmt: skip
            self.totals[key] += after[stat] - before[stat]
        return speed

    def report(self, generated: int) -> dict[str, float]:
        t = self.totals
        return {
            "acceptance": t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
            "mean_accepted": t["accepted"] / t["verifications"] if t["verifications"] else 0.0,
            "forwards_per_token": t["steps"] / generated if generated else 0.0,
        }


def run_spec_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    on = build_engine(settings)
    off = Engine(on.model, on.tokenizer, name=on.name, kv_cache_mb=on.kv_cache_mb, speculate="off")
    gguf = on.source.source if on.source is not None and on.source.source.suffix.lower() == ".gguf" else None
    n, chat_n, reps = args.edit_tokens, args.chat_tokens, args.repeats
    edit = edit_prompt(on)
    chats = [on.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    many = [edit_prompt(on, i) for i in range(args.streams)]
    llama = None
    if args.llamacpp and gguf is not None and llamacpp_baseline.available():
        room = max(len(p) for p in many) + n + 16  # each stream's context in llama.cpp's batch
        llama = llamacpp_baseline.LlamaCppProcess(
            gguf, torch.get_num_threads(), args.streams, room, our_isa=isa_choice()
        )
    runs: dict[str, dict[str, list[float]]] = {w: {} for w in ("edit", "chat", f"streams_{args.streams}")}
    counted = {w: Counted(on) for w in runs}
    generated = dict.fromkeys(runs, 0)
    try:
        ours_single(on, chats[0], 8)  # warm-up
        ours_single(off, chats[0], 8)

        def add(workload: str, who: str, value: float) -> None:
            runs[workload].setdefault(who, []).append(value)

        for _ in range(reps):
            add("edit", "on", counted["edit"](ours_single, edit, n))
            add("edit", "off", ours_single(off, edit, n))
            generated["edit"] += n
            add("chat", "on", statistics.fmean(counted["chat"](ours_single, c, chat_n) for c in chats))
            add("chat", "off", statistics.fmean(ours_single(off, c, chat_n) for c in chats))
            generated["chat"] += chat_n * len(chats)
            key = f"streams_{args.streams}"
            add(key, "on", counted[key](ours_streams, many, n))
            add(key, "off", ours_streams(off, many, n))
            generated[key] += n * len(many)
            if llama is not None:
                for lookup, who in ((True, "llamacpp_lookup"), (False, "llamacpp")):
                    add("edit", who, llama.lookup_decode(edit, n, lookup))
                    add("chat", who, statistics.fmean(llama.lookup_decode(c, chat_n, lookup) for c in chats))
                add(key, "llamacpp", llama.streams(many, n))
    finally:
        if llama is not None:
            llama.close()
        off.shutdown()
        on.shutdown()
    result: dict[str, Any] = {}
    for workload, by in runs.items():
        row: dict[str, Any] = {f"{who}_tok_s": statistics.median(v) for who, v in by.items()}
        row["ratio_vs_off"] = row["on_tok_s"] / row["off_tok_s"]
        for peer in ("llamacpp_lookup", "llamacpp"):
            if f"{peer}_tok_s" in row:
                row[f"ratio_vs_{peer}"] = row["on_tok_s"] / row[f"{peer}_tok_s"]
        row.update(counted[workload].report(generated[workload]))
        result[workload] = row
    result["edit_prompt_tokens"] = len(edit)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print(result, reps, llama is not None)
    return 0


def _print(result: dict[str, Any], reps: int, peer: bool) -> None:
    print(f"tokenwire bench spec — prompt lookup, {torch.get_num_threads()} threads, median of {reps}")
    head = f"{'workload':<12}{'off':>9}{'on':>9}{'on/off':>8}"
    if peer:
        head += f"{'llama.cpp':>11}{'+lookup':>9}{'on/+lookup':>12}"
    print(head + f"{'accept':>8}{'kept/verif':>11}{'fwd/token':>10}")
    for workload, row in result.items():
        if not isinstance(row, dict):
            continue
        line = f"{workload:<12}{row['off_tok_s']:>9.1f}{row['on_tok_s']:>9.1f}{row['ratio_vs_off']:>7.2f}x"
        if peer:
            look = row.get("llamacpp_lookup_tok_s")
            line += f"{row['llamacpp_tok_s']:>11.1f}" + (
                f"{look:>9.1f}{row['ratio_vs_llamacpp_lookup']:>11.2f}x" if look else f"{'-':>9}{'-':>12}"
            )
        line += f"{row['acceptance'] * 100:>7.0f}%{row['mean_accepted']:>11.2f}"
        line += f"{row['forwards_per_token']:>10.2f}"
        print(line)
    print(f"edit prompt: {result['edit_prompt_tokens']} tokens; tok/s (streams: aggregate, wall clock)")


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bs = bench_sub.add_parser("spec", help="prompt-lookup speculation on, off, and llama.cpp's")
    add_model_args(bs)
    bs.add_argument("--json", action="store_true")
    bs.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians reported)")
    bs.add_argument("--edit-tokens", type=int, default=400, help="new tokens of an edit answer")
    bs.add_argument("--chat-tokens", type=int, default=128, help="new tokens of a chat answer")
    bs.add_argument("--streams", type=int, default=32)
    bs.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip llama.cpp")
    lock_hold_bench.add_arguments(bs)
    bs.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.lock_hold:  # the engine lock's hold per step alone (bench/lock_hold_bench.py)
        return lock_hold_bench.run_lock_hold(args, settings_from(args))
    return run_spec_bench(args, settings_from(args))
