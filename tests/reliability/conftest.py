"""Reliability tests: every protocol server of `tokenwire serve`, started in-process through the
same plugins `serve` uses, on the engine with the no-model backend (real scheduler, sessions
and KV blocks; RandomTokenModel skips the forward pass, so these tests are quick)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tokenwire.bench.inprocess import InProcessServers, free_ports, serve_args  # noqa: F401 - for the tests

MODEL = "SmolLM2-135M-Instruct"


# the servers of `serve`, in-process (shared with the soak bench)
Servers = InProcessServers


def random_engine_of(source: Any, **kw: Any) -> Any:
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    return Engine(
        lambda: RandomTokenModel(source.config),
        source.tokenizer,
        name=MODEL,
        kv_cache_mb=kw.pop("kv_cache_mb", 16),
        **kw,
    )


@pytest.fixture(scope="module")
def engine(smollm2_source: Any) -> Iterator[Any]:
    engine = random_engine_of(smollm2_source)
    yield engine
    engine.shutdown()


def idle_baseline(engine: Any) -> dict[str, Any]:
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    return stats


def wait_idle(engine: Any, baseline: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """The engine's stats once nothing runs or waits, its sessions are back to `baseline`'s and
    so are its available KV blocks (AssertionError with the last stats after `timeout` s: a hang
    guard, not a speed claim; a test that means "ended early" counts the tokens computed)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats["running"] == 0
            and stats["waiting"] == 0
            and stats["sessions"] <= baseline["sessions"]
            and stats["kv_blocks_available"] >= baseline["kv_blocks_available"]
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle {timeout}s later: {stats} (baseline {baseline})")
        time.sleep(0.01)
