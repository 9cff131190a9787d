"""The routing simulator of `tokenwire bench scale`: the real Router and SessionTable
(tokenwire/scale) driven by synthetic sessions on simulated replicas, at a scale this machine
cannot run (1,000 replicas, 1,000,000 sessions).

Workload (all drawn from one seeded numpy Generator; the defaults are documented in
docs/scale-out.md):
- sessions arrive as a Poisson process whose rate puts the offered tokens at `utilisation` of
  the replicas' total throughput;
- turns per session: Geometric on 1, 2, ... (mean `mean_turns`); gap between turns: exponential (mean
  `think_s`); new prompt tokens and output tokens per turn: lognormal (median, sigma);
- each session starts with one of `prefixes` system prompts, drawn by a Zipf law (exponent
  `zipf_s`), 64-128 tokens long; a replica's prefix cache keeps its `cache_prefixes` most
  recently used system prompts (LRU): a first turn placed on a replica that holds its system
  prompt is a prefix-cache hit;
- a replica works off `tokens_per_s` tokens per second (prefill and decode alike); its load is
  its outstanding tokens; replicas report their true loads and open sessions to the router
  every `report_s`; between reports the router adds what it dispatched (as in serve);
- a session's map entry goes when it is closed (`close_fraction` of sessions, after their last
  turn) or when it expires (the others, `ttl_s` after their last turn).
"""

from __future__ import annotations

import heapq
import time
import tracemalloc
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tokenwire.scale.directory import SessionTable
from tokenwire.scale.router import PREFIX_BLOCK, Router, prefix_keys

_TURN, _EXPIRE = 0, 1


@dataclass
class SimConfig:
    replicas: int = 1000
    sessions: int = 1_000_000
    seed: int = 0
    tokens_per_s: float = 2000.0
    utilisation: float = 0.7
    mean_turns: float = 3.0
    think_s: float = 20.0
    prompt_median: float = 200.0
    prompt_sigma: float = 0.8
    output_median: float = 120.0
    output_sigma: float = 0.8
    prefixes: int = 10_000
    zipf_s: float = 1.1
    cache_prefixes: int = 32
    report_s: float = 0.25
    close_fraction: float = 0.5
    ttl_s: float = 1800.0
    balance_slack: float = 512.0
    session_weight: float = 1.0
    window_s: float = 10.0  # work-imbalance window


def _lognormal_mean(median: float, sigma: float) -> float:
    return median * float(np.exp(sigma**2 / 2))


PLACEMENTS = ("least-loaded", "least-loaded+prefix", "random")


def simulate(cfg: SimConfig, placement: str) -> dict[str, Any]:
    """One run; `placement`: the Router by load, the Router by load and prefix, or uniformly
    random (the baseline the router is measured against)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    prefix_aware = placement == "least-loaded+prefix"
    rng = np.random.default_rng(cfg.seed)
    n, r_count = cfg.sessions, cfg.replicas
    per_turn = _lognormal_mean(cfg.prompt_median, cfg.prompt_sigma) + _lognormal_mean(
        cfg.output_median, cfg.output_sigma
    )
    rate = cfg.utilisation * r_count * cfg.tokens_per_s / (cfg.mean_turns * per_turn)  # sessions/s
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    turns = rng.geometric(1 / cfg.mean_turns, n)  # 1, 2, ...: mean = mean_turns
    ranks = np.arange(1, cfg.prefixes + 1, dtype=np.float64) ** -cfg.zipf_s
    prefix_of = rng.choice(cfg.prefixes, size=n, p=ranks / ranks.sum())
    closes = rng.random(n) < cfg.close_fraction
    total_turns = int(turns.sum())
    work = (
        rng.lognormal(np.log(cfg.prompt_median), cfg.prompt_sigma, total_turns)
        + rng.lognormal(np.log(cfg.output_median), cfg.output_sigma, total_turns)
    ).tolist()
    thinks = rng.exponential(cfg.think_s, total_turns).tolist()
    # real prefix keys of each system prompt (4..8 blocks of tokens)
    lengths = rng.integers(4, 9, cfg.prefixes) * PREFIX_BLOCK
    keys = [prefix_keys(rng.integers(3, 49000, int(length)).tolist()) for length in lengths]

    router = Router(
        r_count, prefix_aware=prefix_aware, balance_slack=cfg.balance_slack, session_weight=cfg.session_weight
    )
    table = SessionTable()
    true_load = np.zeros(r_count)
    last = np.zeros(r_count)
    live = np.zeros(r_count, dtype=np.int64)
    no_kv = np.zeros(r_count)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(r_count)]
    sids = [uuid.uuid4().hex for _ in range(n)]
    remaining = turns.tolist()
    mu = cfg.tokens_per_s

    events: list[tuple[float, int, int]] = []
    next_arrival, next_report = 0, 0.0
    place_s = lookup_s = 0.0
    places = lookups = hits = 0
    imbalance: list[float] = []
    work_imbalance: list[float] = []
    assigned = np.zeros(r_count)
    next_window = cfg.window_s
    steady = (float(arrivals[n // 10]), float(arrivals[min(n - 1, 9 * n // 10)]))  # sampled span
    session_imbalance: list[float] = []
    peak_entries = 0
    work_i = 0
    started = time.perf_counter()
    while next_arrival < n or events:
        t_arrival = float(arrivals[next_arrival]) if next_arrival < n else float("inf")
        t_event = events[0][0] if events else float("inf")
        now = min(t_arrival, t_event)
        while next_report <= now:  # replicas report their true state
            np.maximum(true_load - mu * (next_report - last), 0.0, out=true_load)
            last[:] = next_report
            router.report_all(true_load, no_kv, live)
            mean = true_load.mean()
            if steady[0] <= next_report <= steady[1]:  # past the warm-up, before the drain
                if mean > 0:
                    imbalance.append(float(true_load.max() / mean))
                session_imbalance.append(float(live.max() / max(live.mean(), 1e-9)))
                if next_report >= next_window:
                    work_imbalance.append(float(assigned.max() / max(assigned.mean(), 1e-9)))
                    assigned[:] = 0
                    next_window = next_report + cfg.window_s
            next_report += cfg.report_s
        if t_arrival <= t_event:  # a new session: the router places it
            s = next_arrival
            next_arrival += 1
            t0 = time.perf_counter()
            if placement == "random":
                replica = int(rng.integers(r_count))
            else:
                replica = router.place(keys[prefix_of[s]]).replica
            place_s += time.perf_counter() - t0
            places += 1
            table.assign(sids[s], replica, "sim")
            router.opened(replica)
            live[replica] += 1
            peak_entries = max(peak_entries, len(table))
            cache = caches[replica]
            pid = int(prefix_of[s])
            if pid in cache:
                hits += 1
                cache.move_to_end(pid)
            else:
                cache[pid] = None
                if len(cache) > cfg.cache_prefixes:
                    cache.popitem(last=False)
            heapq.heappush(events, (now, _TURN, s))
            continue
        _, kind, s = heapq.heappop(events)
        if kind == _EXPIRE:
            table.remove(sids[s])
            continue
        t0 = time.perf_counter()
        replica = table.lookup(sids[s])[0]  # type: ignore[index]
        lookup_s += time.perf_counter() - t0
        lookups += 1
        tokens = work[work_i]
        work_i += 1
        true_load[replica] = max(0.0, true_load[replica] - mu * (now - last[replica])) + tokens
        last[replica] = now
        router.dispatched(replica, tokens)
        assigned[replica] += tokens
        remaining[s] -= 1
        if remaining[s] > 0:
            heapq.heappush(events, (now + tokens / mu + thinks[work_i], _TURN, s))
            continue
        live[replica] -= 1
        router.opened(replica, -1)
        if closes[s]:
            table.remove(sids[s])
        else:
            heapq.heappush(events, (now + cfg.ttl_s, _EXPIRE, s))
    wall = time.perf_counter() - started
    return {
        "placement": placement,
        "sessions": n,
        "replicas": r_count,
        "sim_seconds": float(arrivals[-1]),
        "wall_seconds": wall,
        "placements": places,
        "placements_per_s": places / place_s if place_s else 0.0,
        "lookups_per_s": lookups / lookup_s if lookup_s else 0.0,
        "place_us": 1e6 * place_s / max(places, 1),
        "lookup_us": 1e6 * lookup_s / max(lookups, 1),
        "peak_map_entries": peak_entries,
        "prefix_hit_rate": hits / max(places, 1),
        "load_imbalance_median": float(np.median(imbalance)) if imbalance else 0.0,
        "load_imbalance_p99": float(np.percentile(imbalance, 99)) if imbalance else 0.0,
        "session_imbalance_median": float(np.median(session_imbalance)) if session_imbalance else 0.0,
        "work_imbalance_median": float(np.median(work_imbalance)) if work_imbalance else 0.0,
        "work_imbalance_p99": float(np.percentile(work_imbalance, 99)) if work_imbalance else 0.0,
    }


def session_map_memory(entries: int, replicas: int) -> dict[str, float]:
    """Bytes the SessionTable takes for `entries` sessions (uuid4 hex ids, as the engine makes)."""
    ids = [uuid.uuid4().hex for _ in range(entries)]  # the keys exist anyway (the clients hold them)
    tracemalloc.start()
    table = SessionTable()
    for i, sid in enumerate(ids):
        table.assign(sid, i % replicas, f"inc-{i % replicas}")
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    key_bytes = sum(len(s) + 49 for s in ids[:1000]) / 1000 * entries  # str object size
    return {
        "entries": entries,
        "table_mib": current / 2**20,
        "with_ids_mib": (current + key_bytes) / 2**20,
        "bytes_per_session": (current + key_bytes) / entries,
    }


def config_dict(cfg: SimConfig) -> dict[str, Any]:
    return asdict(cfg)
