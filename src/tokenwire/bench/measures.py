"""Our engine's decode measures, shared by the benchmarks (engine, long_context, spec)."""

from __future__ import annotations

import time

from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent, iter_events


def greedy(n: int, use_prefix_cache: bool = True, speculate: bool = True) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        use_prefix_cache=use_prefix_cache,
        speculate=speculate,
    )


def ours_single(
    engine: Engine, prompt: list[int], n: int, use_prefix_cache: bool = False, speculate: bool = True
) -> float:
    """Greedy decode tok/s, the first token (whose time holds the prefill) excluded. speculate
    False: one token a step, whatever the engine's --speculate (engine/speculation.py)."""
    stamps = []
    for event in iter_events(engine.generate(None, prompt, greedy(n, use_prefix_cache, speculate))):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_streams(engine: Engine, prompts: list[list[int]], n: int, speculate: bool = True) -> float:
    start = time.perf_counter()
    options = greedy(n, use_prefix_cache=False, speculate=speculate)
    handles = [engine.generate(None, p, options) for p in prompts]
    total = sum(len(h.result()[0]) for h in handles)
    return total / (time.perf_counter() - start)


def ours_single_steps(
    engine: Engine, prompt: list[int], n: int, use_prefix_cache: bool = False
) -> tuple[float, float]:
    """ours_single's tok/s and the model steps per second behind it (a step may yield several
    tokens where guesses are kept: engine/speculation.py), the first token's step excluded."""
    stamps = []
    steps = 0
    for event in iter_events(engine.generate(None, prompt, greedy(n, use_prefix_cache))):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                steps = engine.stats()["steps"]
    elapsed = stamps[-1] - stamps[0]
    return (len(stamps) - 1) / elapsed, (engine.stats()["steps"] - steps) / elapsed
