"""`tokenwire bench scale`: what the Ray hop costs, and how the router behaves at 1,000 replicas.

1. Hop: one engine replica on a local Ray cluster (through the ReplicaEngine facade, as
   `serve --replicas 1` runs it) against the in-process Engine, same model (default SmolLM2),
   same settings, loaded side by side in this process; N concurrent greedy streams of
   --tokens tokens each; tokens/s = generated tokens / wall time until every stream ended.
   Rounds interleave (in-process, Ray, Ray, in-process, ...); medians and the ratio.
2. Overhead per request (medians over --calls calls): a session call's round trip, a session
   lookup in the directory actor, and a whole 1-token request (generate + its events), each
   through Ray minus in-process.
3. Routing simulator (bench/scale_sim.py): the real Router and SessionTable at --sim-replicas
   and --sim-sessions, three placements; and the session map's memory at --sim-sessions entries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import replace
from typing import Any

from tokenwire.bench.scale_sim import PLACEMENTS, SimConfig, config_dict, session_map_memory, simulate
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.factory import build_engine
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent
from tokenwire.model.loader import resolve_model
from tokenwire.scale.cluster import ClusterSpec, connect, start_replicas
from tokenwire.scale.facade import ReplicaEngine


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    p = bench_sub.add_parser("scale", help="Ray replica vs in-process engine; the router at 1,000 replicas")
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per stream")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians reported)")
    p.add_argument("--calls", type=int, default=200, help="calls per overhead measure")
    p.add_argument("--replica-cpus", type=float, default=float(os.cpu_count() or 1))
    p.add_argument("--no-hop", dest="hop", action="store_false", help="skip the Ray vs in-process part")
    p.add_argument("--no-sim", dest="sim", action="store_false", help="skip the routing simulator")
    p.add_argument("--sim-replicas", type=int, default=1000)
    p.add_argument("--sim-sessions", type=int, default=1_000_000)
    p.set_defaults(handler=lambda args: run_scale_bench(args, settings_from(args)))


def _options(tokens: int) -> GenerateOptions:
    return GenerateOptions(max_tokens=tokens, sampling=SamplingParams(temperature=0), ignore_eos=True)


async def _streams(engine: Any, streams: int, tokens: int, salt: int) -> float:
    """tokens/s of `streams` concurrent greedy requests (distinct prompts: no shared prefix)."""

    async def one(i: int) -> int:
        prompt = [1, 100 + salt % 1000, 2000 + i, 3000 + i, 4000 + i]
        n = 0
        async for event in engine.generate(None, prompt, _options(tokens)):
            if isinstance(event, TokenEvent) and not event.is_prefill:
                n += 1
            elif isinstance(event, FinishEvent) and event.reason == "error":
                raise RuntimeError(event.error)
        return n

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(counts) / (time.perf_counter() - started)


def _median_us(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _one_token(engine: Any) -> None:
    engine.generate(None, [1, 2, 3], _options(1)).result()


def hop(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    # local: ray is optional (the `ray` extra) and slow to import; `bench --help` loads this module
    import ray

    settings = replace(settings, progress=False)
    local = build_engine(settings)
    spec = ClusterSpec(replicas=1, replica_cpus=args.replica_cpus, namespace=f"tokenwire-bench-{os.getpid()}")
    connect(spec)
    actors, directory, infos = start_replicas(spec, replace(settings, threads=settings.threads))
    source = resolve_model(settings.model, cache_dir=settings.cache_dir)
    remote = ReplicaEngine(actors, directory, infos, source.tokenizer)
    engines = {"in-process": local, "ray": remote}
    try:
        for engine in engines.values():  # warm-up: first-step costs stay out of the medians
            asyncio.run(_streams(engine, 2, 4, 0))
        rows = []
        for streams in [int(s) for s in args.streams.split(",")]:
            got: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(args.repeats):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    got[name].append(asyncio.run(_streams(engines[name], streams, args.tokens, r)))
            med = {name: statistics.median(v) for name, v in got.items()}
            rows.append({
                "streams": streams, "in_process_tok_s": med["in-process"], "ray_tok_s": med["ray"],
                "ratio": med["ray"] / med["in-process"], "rounds": got,
            })  # fmt: skip
        sid_local, sid_remote = local.create_session([1, 2, 3]), remote.create_session([1, 2, 3])
        overhead = {
            "session_call_us": {
                "in_process": _median_us(lambda: local.session_tokens(sid_local), args.calls),
                "ray": _median_us(lambda: remote.session_tokens(sid_remote), args.calls),
            },
            "directory_lookup_us": _median_us(
                lambda: ray.get(directory.lookup.remote(sid_remote)), args.calls
            ),
            "one_token_request_us": {
                "in_process": _median_us(lambda: _one_token(local), args.calls // 4),
                "ray": _median_us(lambda: _one_token(remote), args.calls // 4),
            },
            "place_us_1_replica": _median_us(lambda: remote.router.place(()), args.calls),
        }
        for key in ("session_call_us", "one_token_request_us"):
            overhead[key]["added"] = overhead[key]["ray"] - overhead[key]["in_process"]
        return {"model": local.name, "tokens": args.tokens, "rows": rows, "overhead": overhead}
    finally:
        remote.shutdown()
        local.shutdown()
        ray.shutdown()


def sim(args: argparse.Namespace) -> dict[str, Any]:
    cfg = SimConfig(replicas=args.sim_replicas, sessions=args.sim_sessions)
    runs = [simulate(cfg, placement) for placement in PLACEMENTS]
    memory = session_map_memory(args.sim_sessions, args.sim_replicas)
    return {"config": config_dict(cfg), "runs": runs, "session_map": memory}


def format_report(report: dict[str, Any]) -> str:
    lines = []
    if "hop" in report:
        h = report["hop"]
        lines.append(
            f"Ray replica vs in-process engine ({h['model']}, {h['tokens']} tokens per stream, medians)"
        )
        lines.append(f"{'streams':>8} {'in-process tok/s':>17} {'ray tok/s':>10} {'ratio':>6}")
        for row in h["rows"]:
            lines.append(
                f"{row['streams']:>8} {row['in_process_tok_s']:>17.1f} {row['ray_tok_s']:>10.1f} "
                f"{row['ratio']:>6.2f}"
            )
        o = h["overhead"]
        lines.append(
            f"session call: {o['session_call_us']['in_process']:.0f} us in-process, "
            f"{o['session_call_us']['ray']:.0f} us through Ray (+{o['session_call_us']['added']:.0f} us); "
            f"directory lookup {o['directory_lookup_us']:.0f} us; "
            f"1-token request +{o['one_token_request_us']['added']:.0f} us "
            f"({o['one_token_request_us']['ray']:.0f} vs {o['one_token_request_us']['in_process']:.0f} us); "
            f"placement {o['place_us_1_replica']:.1f} us"
        )
    if "sim" in report:
        s = report["sim"]
        c = s["config"]
        lines.append(f"Routing simulator: {c['replicas']} replicas, {c['sessions']} sessions")
        lines.append(
            f"{'placement':<22} {'decisions/s':>11} {'place us':>9} {'lookup us':>9} {'prefix hit':>10} "
            f"{'work max/mean':>13} {'sessions max/mean':>17} {'peak map':>9}"
        )
        for r in s["runs"]:
            lines.append(
                f"{r['placement']:<22} {r['placements_per_s']:>11.0f} {r['place_us']:>9.1f} "
                f"{r['lookup_us']:>9.2f} "
                f"{r['prefix_hit_rate']:>10.1%} {r['work_imbalance_median']:>13.2f} "
                f"{r['session_imbalance_median']:>17.2f} {r['peak_map_entries']:>9}"
            )
        m = s["session_map"]
        lines.append(
            f"session map at {m['entries']} sessions: {m['table_mib']:.0f} MiB table, "
            f"{m['with_ids_mib']:.0f} MiB with the ids ({m['bytes_per_session']:.0f} B/session)"
        )
    return "\n".join(lines)


def run_scale_bench(args: argparse.Namespace, settings: Any) -> int:
    report: dict[str, Any] = {}
    if args.hop:
        report["hop"] = hop(args, settings)
    if args.sim:
        report["sim"] = sim(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
