"""One local Ray cluster for the whole test session (ray.init costs ~15 s here), a tiny random-
weight model directory the replicas load in a second, and `tokenwire serve` child processes
that join the cluster (--ray-address) with their stderr drained in a thread (a full pipe would
stall the server: every request writes an access-log line)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_process import kill_if_running
from tokenwire.bench.inprocess import free_ports


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray

    # Ray waits 30 s for its raylet to register (node.py's raylet_start_wait_time_s, not a
    # setting); beside the other test worker on 2 cores it once did not, and every test of the
    # module errored (a fresh clone's `make test` at 6b50073; the module alone passed). One retry.
    for attempt in range(2):
        try:
            ray.init(
                num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False,
                namespace="tokenwire-tests",
            )  # fmt: skip
            break
        except Exception as e:
            if attempt or "timed out during startup" not in str(e):
                raise
            ray.shutdown()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


class ServeProcess:
    """`tokenwire serve` on the tiny model: Salience/Evergreen (gRPC), LMTP, GraphPipe, HTTP, metrics."""

    def __init__(self, model: Path, *extra: str, persist: bool = False) -> None:
        """`persist`: sessions persist (--state-dir given in `extra`), which the suite turns off
        for every other server (tests/conftest.py)."""
        self.grpc, self.lmtp, self.http, self.metrics, self.graphpipe = free_ports(5)
        argv = [
            sys.executable, "-m", "tokenwire.cli", "serve", "--model", str(model), "--model-name", "tiny",
            "--grpc-port", str(self.grpc), "--lmtp-port", str(self.lmtp), "--http-port", str(self.http),
            "--metrics-port", str(self.metrics), "--graphpipe-port", str(self.graphpipe),
            "--kv-cache-mb", "8", *extra,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if persist:
            env.pop("TOKENWIRE_NO_PERSIST", None)
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "tokenwire ready" in line:
                self._ready.set()
        self._ready.set()  # the process ended

    def wait_ready(self, timeout: float = 180) -> None:
        self._ready.wait(timeout)
        assert any("tokenwire ready" in line for line in self.lines), "".join(self.lines[-60:])

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        """SIGTERM; the exit code (the server stops its protocols, then Ray, then exits)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_if_running(self.proc)
        self._reader.join(10)
        return self.proc.returncode


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll until predicate() is truthy; returns its value (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
