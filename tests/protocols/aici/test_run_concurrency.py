"""Concurrent /v1/run runs (run_events over one runtime and Coordinator), each consumed the way
AICI REST consumes it: after `initial-run` the consumer pauses (the server prepares and writes
the response) while the run's first request is already in the engine. Every run that is not
abandoned gives exactly what it gives alone; abandoned ones (a client that left, a cancelled
handler) leave nothing behind.

The regression: the fork task cleared its constraint's outcome after the engine had already
consulted it, so a first request that stopped to wait for the others (or to fork) read as the
controller's stop: forks with empty text, `aici-stop` and no error under load.

The engine imitates the default model's shapes with random weights (outputs depend on the
tokens only), so many runs are cheap; the runtime tokenizes with the default model's files.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.reliability.conftest import idle_baseline, random_engine_of, wait_idle
from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.engine_bridge import Coordinator
from tokenwire.protocols.aici.rest import tokenizer_spec
from tokenwire.protocols.aici.run import RunRequest, run_events

# what AICI REST spends between yielding `initial-run` and asking for the next object (headers
# written to a socket, under load): long enough for the engine to reach the first sampling point
RESPONSE_START_S = 0.1
RUN_TIMEOUT_S = 60.0  # a run that hangs fails the test instead of blocking it


@pytest.fixture(scope="module")
def engine(smollm2_source: Any) -> Iterator[Any]:
    engine = random_engine_of(smollm2_source, kv_cache_mb=32)
    engine.source = smollm2_source  # the runtime tokenizes with the model's own files
    yield engine
    engine.shutdown()


@pytest.fixture
def coord(engine: Any, tmp_path: Any) -> Iterator[Coordinator]:
    """A runtime and Coordinator per test: a test that leaves a sequence behind cannot stall the next."""
    client = AiciClient(
        tokenizer=tokenizer_spec(engine), runtime_args=[f"--store-dir={tmp_path}", "--max-pre-ms=50"]
    )
    coord = Coordinator.for_engine(client, engine)
    yield coord
    coord.close()
    client.close()


async def _run(
    engine: Any, coord: Coordinator, body: dict[str, Any], *, pause_s: float = RESPONSE_START_S
) -> dict[int, dict[str, Any]]:
    """The run's forks by index: text, finish_reason and error joined over its objects."""
    forks: dict[int, dict[str, Any]] = {}
    events = run_events(engine, coord.client, coord, RunRequest.from_json(body))
    try:
        async for obj in events:
            if obj["object"] == "initial-run":
                await asyncio.sleep(pause_s)
                continue
            for f in obj["forks"]:
                acc = forks.setdefault(f["index"], {"text": "", "finish_reason": None, "error": ""})
                acc["text"] += f["text"]
                acc["error"] += f["error"]
                acc["finish_reason"] = f["finish_reason"] or acc["finish_reason"]
    finally:
        await events.aclose()
    return forks


async def _abandoned(engine: Any, coord: Coordinator, body: dict[str, Any], how: str) -> None:
    """A run left after its first text: its consumer stops reading ("disconnect", what AICI REST
    does for a client that went away) or its task is cancelled ("cancel")."""
    events = run_events(engine, coord.client, coord, RunRequest.from_json(body))

    async def consume() -> None:
        async for obj in events:
            if any(f["text"] for f in obj.get("forks", [])):
                if how == "disconnect":
                    break
                await asyncio.sleep(3600)  # cancelled here

    task = asyncio.create_task(consume())
    try:
        if how == "cancel":
            await asyncio.sleep(0.2)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await events.aclose()


def _regex(prompt: list[int], n: int) -> dict[str, Any]:
    return {"controller": "regex", "controller_arg": f"[a-z]{{1,{n}}}", "prompt": prompt, "max_tokens": n}


def _assert_coordinator_empty(coord: Coordinator) -> None:
    deadline = time.monotonic() + 5
    while coord.seqs:  # abandoned runs' controllers are freed within the next rounds
        assert time.monotonic() < deadline, f"sequences left in the Coordinator: {coord.seqs}"
        time.sleep(0.01)


def test_concurrent_runs_give_what_each_gives_alone(engine: Any, coord: Coordinator) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    cases = [(i, n) for i in range(len(prompts)) for n in (1, 6, 16)]
    baseline = idle_baseline(engine)

    async def scenario() -> tuple[dict[tuple[int, int], str], list[tuple[tuple[int, int], Any]]]:
        alone = {}
        for i, n in cases:
            forks = await _run(engine, coord, _regex(prompts[i], n), pause_s=0)
            assert list(forks) == [0] and not forks[0]["error"], forks
            assert forks[0]["finish_reason"] in ("aici-stop", "length"), forks
            alone[i, n] = forks[0]["text"]
        assert all(alone.values()), alone  # [a-z]{1,n}: at least one letter each
        together = cases * 2
        rng.shuffle(together)
        runs = [_run(engine, coord, _regex(prompts[i], n)) for i, n in together]
        left = [
            _abandoned(engine, coord, _regex(prompts[k % len(prompts)], 200), how)
            for k, how in enumerate(["disconnect", "cancel", "disconnect", "cancel"])
        ]
        results = await asyncio.wait_for(asyncio.gather(*runs, *left), RUN_TIMEOUT_S)
        return alone, list(zip(together, results[: len(runs)], strict=True))

    alone, together = asyncio.run(scenario())
    wrong = [
        f"prompt {i} n {n}: {json.dumps(forks)} != {alone[i, n]!r}"
        for (i, n), forks in together
        if list(forks) != [0] or forks[0]["text"] != alone[i, n] or forks[0]["error"]
    ]
    assert not wrong, wrong
    wait_idle(engine, baseline, timeout=5)  # no session or request left behind
    _assert_coordinator_empty(coord)


def test_a_fork_at_the_first_step_while_the_response_starts(engine: Any, coord: Coordinator) -> None:
    """The controller forks at its first pre_process, which the engine reaches while the
    consumer is still starting the response: both forks run (the fork outcome was lost, fork 0
    ended empty and its clone was never started)."""
    prog = {"steps": [{"fork": [[{"fixed": " A"}], [{"fixed": " B"}]]}]}
    body = {"controller": "declctrl", "controller_arg": prog, "prompt": "Hello", "max_tokens": 8}
    baseline = idle_baseline(engine)
    forks = asyncio.run(asyncio.wait_for(_run(engine, coord, body), RUN_TIMEOUT_S))
    assert sorted(f["text"] for f in forks.values()) == [" A", " B"], forks
    assert all(f["finish_reason"] == "aici-stop" and not f["error"] for f in forks.values()), forks
    wait_idle(engine, baseline, timeout=5)
    _assert_coordinator_empty(coord)
