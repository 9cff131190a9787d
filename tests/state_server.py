"""A `tokenwire serve` child on a state directory of the test's own (--state-dir), for the tests
of sessions that outlive the process: HTTP calls with or without an API key, /metrics, SIGTERM
and SIGKILL, the server's log (drained by a thread, so a chatty server never blocks on it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.serve_process import kill_if_running, wait_ready
from tokenwire.bench.inprocess import free_ports

MODEL = "SmolLM2-135M-Instruct"


class StateServer:
    def __init__(self, state_dir: Path, *extra: str, kv_cache_mb: float = 64) -> None:
        self.http, self.grpc, self.metrics_port, graphpipe, lmtp = free_ports(5)
        # the suite turns persistence off for every other server (tests/conftest.py)
        env = {k: v for k, v in os.environ.items() if k != "TOKENWIRE_NO_PERSIST"}
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tokenwire.cli", "serve", "--state-dir", str(state_dir),
                "--kv-cache-mb", str(kv_cache_mb), "--http-port", str(self.http),
                "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics_port),
                "--graphpipe-port", str(graphpipe), "--lmtp-port", str(lmtp), *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        try:
            self.lines = wait_ready(self.proc).splitlines(keepends=True)
        except BaseException:
            kill_if_running(self.proc)
            raise
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def call(self, method: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def post(self, path: str, body: Any = None, key: str | None = None) -> Any:
        status, reply = self.call("POST", path, body if body is not None else {}, key)
        assert status == 200, reply
        return reply

    def turn(self, session: str, prompt: list[int], key: str | None = None, max_tokens: int = 4) -> list[Any]:
        """A greedy completion on the session: its tokens and their logprobs, as the wire has them."""
        body = {"model": MODEL, "session": session, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": 1}  # fmt: skip
        logprobs = self.post("/v1/completions", body, key)["choices"][0]["logprobs"]
        return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))

    def tokens(self, session: str, key: str | None = None) -> list[int]:
        status, reply = self.call("GET", f"/v1/sessions/{session}", key=key)
        assert status == 200, reply
        return reply["tokens"]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
        found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert found is not None, f"{name} not in /metrics"
        return float(found.group(1))

    def stop(self) -> str:
        """SIGTERM: the server exits 0 within its grace; its whole log."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self._drain.join(timeout=10)
        assert self.proc.returncode == 0, self.log
        return self.log

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._drain.join(timeout=10)

    def __enter__(self) -> StateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_if_running(self.proc)
