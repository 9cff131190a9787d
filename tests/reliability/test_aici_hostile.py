"""A loop of more than 200 hostile AICI controllers, JavaScript and Wasm (infinite loops,
allocation bombs, deep recursion, huge tables, thrown null, bad host calls and the probe's
findings), through POST /v1/run on one supervised runtime: every run ends with AICI's error
form, the runtime never dies, its resident memory comes back within 100 MiB of where it started,
the server's within 200 MiB, and a normal controller works after it all.

Left out of the loop: the two programs whose fix is to kill the runtime (a catastrophic regex,
QuickJS's native crash when out of memory inside its error path); tests/protocols/aici/
test_sandbox.py covers them, one run each."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.protocols.aici.sandbox_harness import (
    HOSTILE_JS,
    HOSTILE_WASM,
    MIB,
    Served,
    hostile_js_program,
    rss_of,
)
from tests.reliability.conftest import random_engine_of

RUNS = 208  # 8 rounds of the 26 hostile controllers
RUNTIME_GROWTH = 100 * MIB  # the budget the task sets for the runtime
SERVER_GROWTH = 200 * MIB  # the server (this process: engine, REST server, Coordinator)
# a callback that burns its budget burns the instantiate budget: 200 ms (not 1 s) keeps the loop
# short; a normal controller instantiates in a few ms
RUNTIME_ARGS = ("--max-init-ms=200",)


@pytest.fixture(scope="module")
def served(smollm2_source: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    engine = random_engine_of(smollm2_source)
    served = Served(engine, tmp_path_factory.mktemp("aici-hostile"), RUNTIME_ARGS)
    yield served
    served.close()
    engine.shutdown()


def _idle_rss(served: Served) -> int:
    time.sleep(0.3)  # idle: the runtime hands freed controllers' memory back (malloc_trim)
    return served.runtime_rss()


def test_hostile_controllers_leave_the_server_and_runtime_as_they_were(served: Served) -> None:
    modules = {name: served.upload(wasm) for name, wasm in HOSTILE_WASM.items()}
    cases: list[tuple[str, dict[str, Any]]] = [
        (f"wasm {name}", {"controller": module, "controller_arg": ""}) for name, module in modules.items()
    ]
    cases += [
        (f"js {name}", {"controller": "jsctrl-latest", "controller_arg": hostile_js_program(name)})
        for name in HOSTILE_JS
    ]

    def run(name: str, body: dict[str, Any]) -> None:
        got = served.run({**body, "prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert got.status == 200, (name, got)
        assert got.finish in ("fail", "aici-stop", "length"), (name, got)
        assert "died" not in got.error and "did not answer" not in got.error, (name, got.error)

    for name, body in cases:  # once each first: the allocator's and caches' steady state
        run(name, body)
    served.normal_run_works()
    pid, runtime_before, server_before = served.runtime_pid, _idle_rss(served), rss_of()
    peak = runtime_before
    for i in range(RUNS):
        name, body = cases[i % len(cases)]
        run(name, body)
        if i % len(cases) == len(cases) - 1:
            peak = max(peak, served.runtime_rss())
    assert served.runtime_pid == pid, "the runtime died during the loop"
    runtime_after, server_after = _idle_rss(served), rss_of()
    print(
        f"{RUNS} hostile runs: runtime RSS {runtime_before / MIB:.0f} -> {runtime_after / MIB:.0f} MiB "
        f"(peak between rounds {peak / MIB:.0f}), "
        f"server {server_before / MIB:.0f} -> {server_after / MIB:.0f} MiB"
    )
    assert runtime_after - runtime_before < RUNTIME_GROWTH
    assert server_after - server_before < SERVER_GROWTH
    coord = served.server.coord
    assert coord is not None and not coord.seqs, f"{len(coord.seqs)} sequences left in the Coordinator"
    served.normal_run_works()
