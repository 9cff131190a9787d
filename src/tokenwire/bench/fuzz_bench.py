"""`tokenwire bench fuzz --cases N`: random and damaged inputs through every network decoder
(fuzz_targets.py: LMTP frames, GraphPipe flatbuffers, AICI shared-memory messages, Salience and
Evergreen protobufs, OpenAI JSON bodies) and small inputs that imply large work
(fuzz_structures.py: shared Evergreen DAGs over several messages, nested grammars, oversized
token arrays, each with a time budget), grammars deep in rules, references and nesting
(fuzz_grammar_depth.py), round-robin, on the engine with the no-model backend.

Reports cases run per target, how many got a valid answer or the protocol's error, the
distinct failures (an exception type at a place in tokenwire's code; the first input of each
is shown) and the time. Exit status 1 when any case failed. Reproducible: --seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tokenwire.bench.fuzz_grammar_depth import grammar_depth_target
from tokenwire.bench.fuzz_structures import structure_targets
from tokenwire.bench.fuzz_targets import all_targets
from tokenwire.bench.random_tokens import RandomTokenModel
from tokenwire.engine.engine import Engine
from tokenwire.model.loader import resolve_model

DEFAULT_CASES = 100_000


@dataclass
class TargetReport:
    name: str
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


@dataclass
class FuzzReport:
    targets: dict[str, TargetReport]
    failures: dict[str, dict[str, str]]  # signature -> {message, input}
    seconds: float

    @property
    def cases(self) -> int:
        return sum(t.cases for t in self.targets.values())

    def json(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "distinct_failures": len(self.failures),
            "seconds": round(self.seconds, 2),
            "targets": {
                t.name: {"cases": t.cases, **dict(t.outcomes), "seconds": round(t.seconds, 2)}
                for t in self.targets.values()
            },
            "failures": self.failures,
        }


def signature(target: str, exc: BaseException) -> str:
    """Where in tokenwire's code an exception escaped: one failure however many inputs hit it."""
    frames = traceback.extract_tb(exc.__traceback__)
    over = isinstance(exc, OverBudget)  # a runaway is cut at any line of its loop: name the function
    where = next(
        (
            f"{f.filename.rsplit('tokenwire/', 1)[-1]}:{f.name if over else f.lineno}"
            for f in reversed(frames)
            if "tokenwire" in f.filename and not f.filename.endswith("fuzz_bench.py")  # not the alarm
        ),
        "?",
    )
    return f"{target}: {type(exc).__name__} at {where}"


class OverBudget(BaseException):
    """A case that was not answered within its target's budget (a BaseException, so no
    `except Exception` in the code under test can swallow it)."""


@contextmanager
def time_budget(seconds: float | None) -> Iterator[None]:
    """Cut the case off with SIGALRM after `seconds`: a runaway case (a pure-Python loop over a
    graph's expansion) is stopped, not waited for. Main thread only (signals); elsewhere the
    elapsed time alone is checked by the caller."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(_signum: int, _frame: Any) -> None:
        raise OverBudget(f"not answered within its budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_fuzz(engine: Any, cases: int, seed: int = 0, only: list[str] | None = None) -> FuzzReport:
    every = all_targets(engine) + structure_targets(engine) + [grammar_depth_target(engine)]
    targets = [t for t in every if not only or t.name in only]
    if not targets:
        raise ValueError(f"no fuzz target named {only}")
    return run_targets(targets, cases, seed)


def run_targets(targets: list[Any], cases: int, seed: int = 0) -> FuzzReport:
    """`cases` inputs over `targets`, round-robin, each within its target's budget."""
    rngs = {t.name: random.Random(f"{seed}:{t.name}") for t in targets}
    reports = {t.name: TargetReport(t.name) for t in targets}
    failures: dict[str, dict[str, str]] = {}
    started = time.perf_counter()
    for i in range(cases):
        target = targets[i % len(targets)]
        report = reports[target.name]
        case = target.make(rngs[target.name])
        t0 = time.perf_counter()
        try:
            with time_budget(target.budget_s):
                outcome = target.run(case)
            took = time.perf_counter() - t0
            if target.budget_s is not None and took > target.budget_s:  # a C call the alarm could not cut
                raise OverBudget(f"answered after {took:.2f} s, over its budget of {target.budget_s:g} s")
            report.outcomes[outcome] += 1
        except (Exception, OverBudget) as exc:  # a failure: recorded, and the run goes on
            report.outcomes["failed"] += 1
            failures.setdefault(
                signature(target.name, exc), {"message": str(exc)[:300], "input": repr(case)[:300]}
            )
        report.seconds += time.perf_counter() - t0
        report.cases += 1
    return FuzzReport(reports, failures, time.perf_counter() - started)


def run_fuzz_bench(args: argparse.Namespace) -> int:
    logging.getLogger("tokenwire").setLevel(logging.ERROR)  # refusals log warnings by design
    source = resolve_model(args.model)
    engine = Engine(
        lambda: RandomTokenModel(source.config), source.tokenizer, name=source.name, kv_cache_mb=16
    )
    try:
        report = run_fuzz(engine, args.cases, args.seed, args.target or None)
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(report.json(), indent=1))
    else:
        print(f"{'target':<10} {'cases':>8} {'ok':>8} {'refused':>8} {'failed':>7} {'seconds':>8}")
        for t in report.targets.values():
            o = t.outcomes
            print(
                f"{t.name:<10} {t.cases:>8} {o['ok']:>8} {o['refused']:>8} {o['failed']:>7} {t.seconds:>8.1f}"
            )
        failed = sum(t.outcomes["failed"] for t in report.targets.values())
        print(f"{'all':<10} {report.cases:>8} {'':>8} {'':>8} {failed:>7} {report.seconds:>8.1f}")
        print(f"distinct failures: {len(report.failures)}")
        for sig, info in report.failures.items():
            print(f"  {sig}\n    {info['message']}\n    input: {info['input']}")
    return 1 if report.failures else 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("fuzz", help="random and damaged inputs through every protocol decoder")
    p.add_argument("--cases", type=int, default=DEFAULT_CASES, help="cases over all targets (round-robin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--target", action="append", help="only this target (repeatable): lmtp, graphpipe, evergreen_dag, ..."
    )
    p.add_argument("--model", help="whose tokenizer and vocabulary (default: the default model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_fuzz_bench)


if __name__ == "__main__":  # pragma: no cover - `tokenwire bench fuzz` is the entry point
    sys.exit(
        run_fuzz_bench(argparse.Namespace(cases=DEFAULT_CASES, seed=0, target=None, model=None, json=False))
    )
