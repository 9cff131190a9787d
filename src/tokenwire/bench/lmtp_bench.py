"""`tokenwire bench lmtp`: tokens/s an LMTP client receives, in one run, side by side.

Servers, each in its own process (so the client's process does not share their CPU time
slices or event loop):
- tokenwire: our LMTP server over the real engine with a no-model backend
  (RandomTokenModel: scheduler, KV, sampler and LMTP all run; the forward pass does not);
- lmql: `lmql serve-model random` (LMQL 0.7.3's server with its random backend);
- echo: a bare aiohttp WebSocket server that streams TOKEN frames without any engine (the
  transport's limit);
- tokenwire, real model: end-to-end with SmolLM2 (unless --no-real).
The client is a plain aiohttp WebSocket: one connection, N streams sent at once (like
LMQL's client), greedy, fixed max_tokens; tokens/s = records received / wall time until
every stream finished. Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp


@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen[str]
    port: int

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ours(kind: str) -> ServerProcess:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenwire.bench.lmtp_bench_servers", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"bench server {kind!r} did not start")
    return ServerProcess(kind, proc, int(line.split()[1]))


def start_lmql() -> ServerProcess:
    exe = shutil.which("lmql") or os.path.join(os.path.dirname(sys.executable), "lmql")
    if not os.path.exists(exe):
        raise RuntimeError("lmql is not installed (pip install lmql==0.7.3)")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "serve-model", "random", "--port", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return ServerProcess("lmql", proc, port)
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("lmql serve-model random did not start")


async def receive_tokens(
    port: int, model: str, streams: int, max_tokens: int, prompt: list[int]
) -> tuple[int, float]:
    """One connection, `streams` GENERATE requests at once; returns (tokens received, seconds)."""
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(f"http://127.0.0.1:{port}/", max_msg_size=0) as ws,
    ):
        start = time.perf_counter()
        for sid in range(streams):
            body = {
                "stream_id": sid,
                "model": model,
                "prompt": [*prompt, sid],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "top_logprobs": 1,
                "ignore_eos": True,
            }
            await ws.send_str("GENERATE " + json.dumps(body))
        tokens, open_streams = 0, set(range(streams))
        async for msg in ws:
            kind, _, body_text = msg.data.partition(" ")
            if kind != "TOKEN":
                continue
            for record in json.loads(body_text):
                if record.get("error"):
                    raise RuntimeError(f"stream {record.get('stream_id')}: {record['error']}")
                tokens += 1
                if record.get("finish_reason") is not None:
                    open_streams.discard(record["stream_id"])
            if not open_streams:
                break
        elapsed = time.perf_counter() - start
    return tokens, elapsed


def tokens_per_s(port: int, model: str, streams: int, max_tokens: int, prompt: list[int]) -> float:
    tokens, seconds = asyncio.run(receive_tokens(port, model, streams, max_tokens, prompt))
    if tokens != streams * max_tokens:
        raise RuntimeError(f"expected {streams * max_tokens} tokens, received {tokens}")
    return tokens / seconds


def measure(server: ServerProcess, model: str, streams: int, max_tokens: int, repeats: int) -> float:
    prompt = [1, 504, 3458, 314]
    asyncio.run(receive_tokens(server.port, model, 1, 4, prompt))  # warm-up
    return statistics.median(
        tokens_per_s(server.port, model, streams, max_tokens, prompt) for _ in range(repeats)
    )


def run_lmtp_bench(args: argparse.Namespace) -> int:
    stream_counts = [1, args.streams]
    backends: list[tuple[str, str, str]] = [
        ("tokenwire (no-model backend)", "random", "random"),
        ("lmql serve-model random", "lmql", "random"),
        ("bare aiohttp echo", "echo", "echo"),
    ]
    if not args.no_real:
        backends.append(("tokenwire (SmolLM2, end to end)", "real", "SmolLM2-135M-Instruct"))
    results: dict[str, dict[str, float]] = {}
    for label, kind, model in backends:
        server = start_lmql() if kind == "lmql" else start_ours(kind)
        try:
            tokens = args.real_tokens if kind == "real" else args.tokens
            results[kind] = {
                f"streams_{n}": measure(server, model, n, tokens, args.repeats) for n in stream_counts
            }
        finally:
            server.stop()
        results[kind]["label"] = label  # type: ignore[assignment]
    ratios = {
        f"streams_{n}": {
            "vs_lmql": results["random"][f"streams_{n}"] / results["lmql"][f"streams_{n}"],
            "of_echo": results["random"][f"streams_{n}"] / results["echo"][f"streams_{n}"],
        }
        for n in stream_counts
    }
    if args.json:
        print(json.dumps({"tok_s": results, "ratios": ratios}, indent=2))
        return 0
    print(
        f"tokenwire bench lmtp — tokens/s received by one client, {args.tokens} tokens a stream "
        f"({args.real_tokens} on the real model), median of {args.repeats}"
    )
    print(f"{'server':<34}" + "".join(f"{f'{n} stream(s)':>16}" for n in stream_counts))
    for row in results.values():
        print(f"{row['label']:<34}" + "".join(f"{row[f'streams_{n}']:>12.0f} t/s" for n in stream_counts))
    for label, key in (("tokenwire / lmql", "vs_lmql"), ("tokenwire / echo", "of_echo")):
        print(f"{label:<34}" + "".join(f"{ratios[f'streams_{n}'][key]:>15.2f}x" for n in stream_counts))
    print("targets: tokenwire >= 5x lmql; tokenwire >= 0.5x echo (within 2x of the bare transport)")
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("lmtp", help="LMTP tokens/s: tokenwire vs lmql serve-model vs a bare echo")
    p.add_argument("--json", action="store_true")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the second column")
    p.add_argument("--tokens", type=int, default=256, help="tokens a stream (no-model backends)")
    p.add_argument("--real-tokens", type=int, default=32, help="tokens a stream on the real model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-real", action="store_true", help="skip the end-to-end real-model row")
    p.set_defaults(handler=run_lmtp_bench)
