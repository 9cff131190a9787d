"""The routing simulator of `tokenwire bench scale` at a small scale: it drives the real Router,
and what it reports separates the placements (load beats random, prefix-aware beats load-only on
prefix-cache hits)."""

from __future__ import annotations

import pytest

from tokenwire.bench.scale_sim import SimConfig, session_map_memory, simulate


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    cfg = SimConfig(replicas=50, sessions=6000, prefixes=2000, cache_prefixes=8, seed=3)
    return {p: simulate(cfg, p) for p in ("least-loaded", "least-loaded+prefix", "random")}


def test_every_session_is_placed_once_and_its_turns_follow_the_map(runs) -> None:
    for r in runs.values():
        assert r["placements"] == 6000
        assert 0 < r["peak_map_entries"] <= 6000
        assert r["place_us"] > 0 and r["lookup_us"] > 0


def test_least_loaded_spreads_work_better_than_random(runs) -> None:
    assert runs["least-loaded"]["work_imbalance_median"] < runs["random"]["work_imbalance_median"]
    assert runs["least-loaded"]["session_imbalance_median"] < runs["random"]["session_imbalance_median"]


def test_prefix_aware_placement_raises_the_prefix_cache_hit_rate(runs) -> None:
    assert runs["least-loaded+prefix"]["prefix_hit_rate"] > 1.5 * runs["least-loaded"]["prefix_hit_rate"]


def test_session_map_memory_is_measured_per_entry() -> None:
    m = session_map_memory(20_000, 100)
    assert m["entries"] == 20_000
    assert 20 < m["bytes_per_session"] < 1000 and m["with_ids_mib"] > m["table_mib"] > 0
