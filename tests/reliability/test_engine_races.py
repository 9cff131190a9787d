"""Found by the soak bench: a request cancelled (or its session closed) while its step ran freed
the KV blocks the step was using ("model step failed: list index out of range" for the whole
batch, and blocks handed to another session while still being written). Now the blocks of the
step's sessions are freed once the step is over."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import pytest

from tests.reliability.conftest import random_engine_of
from tokenwire.engine.request import GenerateOptions


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_ending_requests_mid_step_fails_no_step(
    smollm2_source: Any, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = random_engine_of(smollm2_source, kv_cache_mb=64)
    total = engine.stats()["kv_blocks_total"]
    failures: list[str] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(3, 40))]
            sid = engine.create_session() if how == "close" else None
            handle = engine.generate(sid, prompt, GenerateOptions(max_tokens=2000, ignore_eos=True))
            time.sleep(rng.random() * 0.03)
            if how == "cancel":
                handle.cancel()
            else:
                engine.close_session(sid)
            reason = handle.result()[1]
            if reason.reason == "error":
                failures.append(str(reason.error))

    try:
        with caplog.at_level(logging.ERROR, logger="tokenwire.engine"):
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not failures, failures[:3]
        assert "model step failed" not in caplog.text
        # the step running at the last cancel frees its blocks at its end (a hang guard: the
        # assertions below say what must hold once it has)
        deadline = time.monotonic() + 10
        while engine.stats()["kv_blocks_available"] < total and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert (stats["running"], stats["waiting"], stats["sessions"]) == (0, 0, 0), stats
        assert stats["kv_blocks_available"] == total, stats
    finally:
        engine.shutdown()


def test_kv_exhaustion_with_many_sessions_evicts_or_refuses(smollm2_source: Any) -> None:
    """More open sessions than the KV budget holds: idle sessions give their blocks back (and
    recompute when used again), a request that cannot fit is refused with the KV error; no step
    fails and the engine keeps serving."""
    from tokenwire.engine.errors import KVBudgetError

    engine = random_engine_of(smollm2_source, kv_cache_mb=0.25)
    try:
        total = engine.stats()["kv_blocks_total"]
        block = engine.kv.block_size
        greedy = GenerateOptions(max_tokens=4)
        sessions = [engine.create_session() for _ in range(2 * total)]  # more than fit (2 blocks each)
        rng = random.Random(0)
        for sid in sessions:  # each holds blocks once done, idle
            events, finish = engine.generate(
                sid, [rng.randrange(3, 40000) for _ in range(block)], greedy
            ).result()
            assert finish.reason == "length" and len(events) == 4, finish
        again = engine.generate(sessions[0], [5], greedy).result()  # evicted long ago: recomputed
        assert again[1].reason == "length"
        handles = [engine.generate(sid, [7], greedy) for sid in rng.sample(sessions, 8)]  # at once
        reasons = [h.result()[1] for h in handles]
        assert all(r.reason == "length" or "KV cache budget" in str(r.error) for r in reasons), reasons
        with pytest.raises(KVBudgetError, match="KV cache budget"):  # alone larger than the budget
            engine.generate(None, [3] * (block * total + 1), greedy)
        events, finish = engine.generate(None, [1, 2, 3], greedy).result()
        assert finish.reason == "length"
    finally:
        engine.shutdown()
