"""`tokenwire bench sessions`: sessions that outlive the process (docs/sessions.md), measured on a
real `tokenwire serve` child on a temporary --state-dir.

N sessions (--sessions, default 200) of --history tokens (default 2,048, distinct random tokens:
no prefix shared), a RAM KV budget of --ram-sessions of them (default 4: far fewer than N), then:

1. a turn on each (max_tokens 1): its KV is nowhere, the whole history is computed: TTFT **by
   re-prefill**; a second turn at once: its KV is in RAM: TTFT **from RAM**;
2. a turn on each again: all but the last few were evicted from RAM to block files meanwhile:
   TTFT **from disk** (same process);
3. SIGTERM, start again: **restart-to-ready** (process start to "tokenwire ready"), sessions
   restored, then a turn on each: TTFT **from disk after the restart**;
4. a long turn in flight on one session, SIGKILL, start again: sessions present with every
   committed turn (only the in-flight one lost), restart-to-ready;
5. bytes of block files per stored token.

TTFT is the client's time for a one-token completion on the session (medians). The model is the
shipped one, or `--shape NAME` (a random-weight file at that model's widths, bench/shapes.py).
Targets (issue 44): disk turn >= 10x faster than re-prefill at 2k tokens, within 3x of RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tokenwire.bench.inprocess import free_ports
from tokenwire.bench.shapes import SHAPES, check, shape_file
from tokenwire.engine.kv_cache import kv_bytes_per_token
from tokenwire.model.cache_dir import default_cache_dir
from tokenwire.model.loader import resolve_model


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("sessions", help="sessions across restarts: TTFT from RAM, disk, re-prefill")
    p.add_argument("--model", help="a GGUF or model directory (default: the shipped model)")
    p.add_argument("--shape", help=f"a random-weight model at these widths instead: {', '.join(SHAPES)}")
    p.add_argument("--quant", default="Q4_0", help="the --shape file's weight type (bench/shapes.py)")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--sessions", type=int, default=200, help="sessions (default 200)")
    p.add_argument("--history", type=int, default=2048, help="tokens of each session's history")
    p.add_argument("--ram-sessions", type=int, default=4, help="histories the RAM KV budget holds")
    p.add_argument("--state-dir", type=Path, help="default: a temporary directory, removed after")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_sessions_bench)


class Server:
    """One `tokenwire serve` child on the bench's state directory."""

    def __init__(self, args: list[str]) -> None:
        self.http, metrics, grpc, graphpipe, lmtp = free_ports(5)
        env = {k: v for k, v in os.environ.items() if k != "TOKENWIRE_NO_PERSIST"}
        command = [sys.executable, "-m", "tokenwire.cli", "serve", *args, "--http-port", str(self.http),
                   "--metrics-port", str(metrics), "--grpc-port", str(grpc),
                   "--graphpipe-port", str(graphpipe), "--lmtp-port", str(lmtp)]  # fmt: skip
        started = time.perf_counter()
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if "tokenwire ready" in line:
                break
        else:
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))
        self.ready_s = time.perf_counter() - started
        threading.Thread(target=self._drain, daemon=True).start()
        self.model = self.call("/v1/models")["data"][0]["id"]

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def call(self, path: str, body: Any | None = None, timeout: float = 600) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", data,
                                         {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read().decode()[:500]}") from None

    def turn(self, session: str, token: int) -> float:
        """Seconds for a one-token greedy completion appending `token` to the session."""
        body = {"model": self.model, "session": session, "prompt": [token], "max_tokens": 1,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        started = time.perf_counter()
        self.call("/v1/completions", body)
        return time.perf_counter() - started

    def tokens(self, session: str) -> list[int] | None:
        try:
            return self.call(f"/v1/sessions/{session}")["tokens"]
        except RuntimeError:  # not found
            return None

    def stop(self, sig: int) -> float:
        started = time.perf_counter()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=600)
        return time.perf_counter() - started


def run_sessions_bench(args: argparse.Namespace) -> int:
    cache_dir = args.cache_dir or default_cache_dir()
    model = args.model
    if args.shape:
        check(args.shape, args.quant)
        model = str(shape_file(args.shape, args.quant, cache_dir))
    source = resolve_model(model, cache_dir=args.cache_dir)
    per_token = kv_bytes_per_token(source.config, "fp16")  # a quantised model's KV: fp16 (auto)
    kv_mb = args.ram_sessions * (args.history + 64) * per_token / 2**20
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="tokenwire-bench-sessions-"))
    serve = ["--state-dir", str(state), "--kv-cache-mb", f"{kv_mb:.1f}",
             "--max-model-len", str(args.history + 4096), "--shutdown-grace", "600"]  # fmt: skip
    if model:
        serve += ["--model", model]
    if args.cache_dir:
        serve += ["--cache-dir", str(args.cache_dir)]
    try:
        result = _measure(args, serve, state)
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    result |= {"model": args.shape or source.name, "kv_bytes_per_token_ram": per_token, "kv_cache_mb": kv_mb}
    _report(result, args.json)
    return 0


def _measure(args: argparse.Namespace, serve: list[str], state: Path) -> dict[str, Any]:
    rng = random.Random(44)
    n, history = args.sessions, args.history
    server = Server(serve)
    ttft: dict[str, list[float]] = {"reprefill": [], "ram": [], "disk": [], "disk_after_sigterm": [],
                                    "after_sigkill": []}  # fmt: skip
    try:
        sessions = []
        for _ in range(n):
            prompt = [rng.randrange(100, 40000) for _ in range(history)]
            sessions.append(server.call("/v1/sessions", {"model": server.model, "prompt": prompt})["id"])
        for sid in sessions:
            ttft["reprefill"].append(server.turn(sid, 13))
            ttft["ram"].append(server.turn(sid, 13))
        for sid in sessions[: max(1, n - args.ram_sessions)]:  # evicted from RAM by the later ones
            ttft["disk"].append(server.turn(sid, 13))
        expected = {sid: server.tokens(sid) for sid in sessions}
        sigterm_s = server.stop(signal.SIGTERM)
    except BaseException:
        server.proc.kill()
        raise
    disk_bytes = sum(f.stat().st_size for f in (state / "kv").rglob("*.kv"))
    stored_tokens = sum(len(t or ()) // 16 * 16 for t in expected.values())
    server = Server(serve)
    after_sigterm = {"ready_s": server.ready_s, "sigterm_exit_s": sigterm_s}
    try:
        after_sigterm["sessions_lost"] = sum(server.tokens(sid) != expected[sid] for sid in sessions)
        for sid in sessions:
            ttft["disk_after_sigterm"].append(server.turn(sid, 13))
            expected[sid] = server.tokens(sid)
        victim = sessions[0]
        body = {"model": server.model, "session": victim, "prompt": [13], "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        threading.Thread(target=lambda: _ignore(server.call, "/v1/completions", body), daemon=True).start()
        time.sleep(2.0)  # the long turn is in flight
        server.stop(signal.SIGKILL)
    except BaseException:
        server.proc.kill()
        raise
    server = Server(serve)
    after_sigkill = {"ready_s": server.ready_s}
    try:
        lost = [sid for sid in sessions if server.tokens(sid) != expected[sid]]
        after_sigkill["sessions_lost"] = len(lost)
        after_sigkill["in_flight_session_kept_committed"] = victim not in lost
        for sid in sessions:
            ttft["after_sigkill"].append(server.turn(sid, 13))
        server.stop(signal.SIGTERM)
    except BaseException:
        server.proc.kill()
        raise
    medians = {k: statistics.median(v) for k, v in ttft.items() if v}
    return {
        "sessions": n,
        "history_tokens": history,
        "ram_sessions": args.ram_sessions,
        "ttft_s": medians,
        "disk_vs_reprefill": medians["reprefill"] / medians["disk_after_sigterm"],
        "disk_vs_ram": medians["disk_after_sigterm"] / medians["ram"],
        "after_sigterm": after_sigterm,
        "after_sigkill": after_sigkill,
        "disk_bytes": disk_bytes,
        "disk_bytes_per_token": disk_bytes / stored_tokens if stored_tokens else None,
    }


def _ignore(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        pass  # the server was killed under it


def _report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    t = result["ttft_s"]
    print(f"sessions bench: {result['sessions']} sessions of {result['history_tokens']} tokens, "
          f"model {result['model']}, RAM KV {result['kv_cache_mb']:.0f} MiB "
          f"(~{result['ram_sessions']} histories)")  # fmt: skip
    print(f"{'turn TTFT (median)':<34}{'seconds':>10}")
    labels = {"ram": "KV in RAM", "disk": "KV from disk (same process)",
              "disk_after_sigterm": "KV from disk after SIGTERM restart",
              "after_sigkill": "after SIGKILL restart", "reprefill": "re-prefill (no KV)"}  # fmt: skip
    for key, label in labels.items():
        if key in t:
            print(f"  {label:<32}{t[key]:>10.4f}")
    print(f"disk turn vs re-prefill: {result['disk_vs_reprefill']:.1f}x faster (target >= 10x)")
    print(f"disk turn vs RAM turn:   {result['disk_vs_ram']:.2f}x (target <= 3x)")
    s, k = result["after_sigterm"], result["after_sigkill"]
    print(f"SIGTERM: exit {s['sigterm_exit_s']:.1f}s, restart-to-ready {s['ready_s']:.1f}s, "
          f"sessions lost {s['sessions_lost']}")  # fmt: skip
    kept = k["in_flight_session_kept_committed"]
    print(f"SIGKILL: restart-to-ready {k['ready_s']:.1f}s, sessions lost {k['sessions_lost']} "
          f"(the in-flight turn's session kept its committed turns: {kept})")  # fmt: skip
    per = result["disk_bytes_per_token"]
    print(f"disk: {result['disk_bytes'] / 2**20:.1f} MiB of block files, {per:.0f} bytes a stored token "
          f"(RAM: {result['kv_bytes_per_token_ram']:.0f})")  # fmt: skip
