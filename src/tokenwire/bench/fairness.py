"""`tokenwire bench soak --long-prompt N`: what a long prompt costs its neighbours (issue 41).

On the real model (the default, or --model), in-process, three things, each with the
scheduler's prefill share "fair" (prompts at one priority share each step evenly) and "arrival"
(the old order: the first prompt takes whole steps) in interleaved rounds:

* the time to first token of a short chat prompt alone;
* the same prompt submitted while an N-token prompt is being read: its TTFT, and how many
  engine steps it waited;
* a request decoding beside that N-token prompt: the longest gap between its tokens, in steps
  (a decode row runs every step under both policies: the share is about prompts).

Medians over the rounds; the ratio beside/alone is what a user feels.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from tokenwire.engine.request import GenerateOptions, SamplingParams, iter_events

SHORT_PROMPT = 16
GREEDY = SamplingParams(temperature=0.0)


def _ttft(engine: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds and engine steps from submitting `prompt` to its first token."""
    steps, began = engine.steps, time.perf_counter()
    handle = engine.generate(None, prompt, GenerateOptions(max_tokens=1, ignore_eos=True, sampling=GREEDY))
    handle.result()
    return time.perf_counter() - began, engine.steps - steps


def _prompt(engine: Any, n: int, salt: int) -> list[int]:
    # distinct tokens per round: no prefix-cache hit turns a read into a lookup
    return [(salt * 7919 + i * 31) % (engine.vocab_size - 10) + 5 for i in range(n)]


def _beside_long(engine: Any, n: int, salt: int) -> tuple[float, int]:
    """The short prompt's TTFT once the long one has begun to be read."""
    steps_before = engine.steps
    long = engine.generate(
        None, _prompt(engine, n, salt), GenerateOptions(max_tokens=1, ignore_eos=True, sampling=GREEDY)
    )
    while engine.steps == steps_before:  # its first chunk is in the model
        time.sleep(0.001)
    out = _ttft(engine, _prompt(engine, SHORT_PROMPT, salt + 1))
    long.result()
    return out


def _decode_gap(engine: Any, n: int, salt: int) -> int:
    """The most engine steps between two tokens of a request decoding while an n-token prompt
    is read."""
    gaps: list[int] = []
    opts = GenerateOptions(max_tokens=10_000, ignore_eos=True, sampling=GREEDY)
    decoding = engine.generate(None, _prompt(engine, SHORT_PROMPT, salt), opts)
    stop = threading.Event()

    def watch() -> None:
        last = None
        for _event in iter_events(decoding):
            now = engine.steps
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                break

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    while not gaps:
        time.sleep(0.001)
    long = engine.generate(
        None, _prompt(engine, n, salt + 2), GenerateOptions(max_tokens=1, ignore_eos=True, sampling=GREEDY)
    )
    long.result()
    stop.set()
    decoding.cancel()
    watcher.join(timeout=60)
    return max(gaps)


def measure(engine: Any, n: int, rounds: int = 3) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {
        share: {"ttft_alone_s": [], "ttft_beside_s": [], "steps_waited": [], "decode_gap_steps": []}
        for share in ("fair", "arrival")
    }
    for r in range(rounds):
        for share in ("fair", "arrival") if r % 2 == 0 else ("arrival", "fair"):
            engine.scheduler.prefill_share = share
            out = results[share]
            salt = 1000 * r + (0 if share == "fair" else 500)
            out["ttft_alone_s"].append(_ttft(engine, _prompt(engine, SHORT_PROMPT, salt))[0])
            seconds, steps = _beside_long(engine, n, salt + 10)
            out["ttft_beside_s"].append(seconds)
            out["steps_waited"].append(steps)
            out["decode_gap_steps"].append(_decode_gap(engine, n, salt + 20))
    engine.scheduler.prefill_share = "fair"
    report: dict[str, Any] = {"long_prompt": n, "short_prompt": SHORT_PROMPT, "rounds": rounds}
    for share, out in results.items():
        medians = {k: statistics.median(v) for k, v in out.items()}
        medians["beside_over_alone"] = medians["ttft_beside_s"] / medians["ttft_alone_s"]
        report[share] = medians
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"short prompt ({report['short_prompt']} tokens) beside a {report['long_prompt']}-token prompt, "
        f"medians of {report['rounds']} rounds"
    )
    head = ("prefill share", "TTFT alone", "TTFT beside", "ratio", "steps", "decode gap")
    print(f"{head[0]:<14} {head[1]:>11} {head[2]:>12} {head[3]:>7} {head[4]:>6} {head[5]:>11}")
    for share in ("fair", "arrival"):
        m = report[share]
        print(
            f"{share:<14} {m['ttft_alone_s']:>10.3f}s {m['ttft_beside_s']:>11.3f}s "
            f"{m['beside_over_alone']:>6.1f}x {m['steps_waited']:>6.0f} {m['decode_gap_steps']:>11.0f}"
        )
