"""A short soak in the suite (the 2-minute, 64-session run is `tokenwire bench soak`): every
protocol at once with greedy requests, forks, cancels, disconnects and bad requests; no wrong
output, no unexpected error, and the engine's KV blocks and sessions back to their baseline."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.reliability.conftest import Servers
from tokenwire.bench.soak_bench import Soak


def test_short_soak_every_protocol(smollm2_source: Any) -> None:
    from tests.reliability.conftest import random_engine_of

    engine = random_engine_of(smollm2_source, kv_cache_mb=32)
    engine.source = smollm2_source  # the AICI runtime tokenizes with the model's files
    servers = Servers(engine, aici=True)
    try:
        report = asyncio.run(Soak(servers, engine, sessions=12, seconds=8, seed=1).run())
    finally:
        servers.stop()
        engine.shutdown()
    assert report["requests"] > 50, report
    assert report["wrong_outputs"] == 0, report["wrong_examples"]
    assert report["errors"] == {}, report["errors"]
    assert sum(report["refused_bad_requests"].values()) > 0  # the bad requests got their errors
    assert report["kv_free_blocks"]["after"] == report["kv_free_blocks"]["before"], report
    assert report["engine_after"] == report["engine_before"], report
