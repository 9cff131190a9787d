"""`tokenwire bench soak --minutes M --sessions S`: every protocol at once, for minutes.

The servers of `serve` run in this process (bench/inprocess.py) on the engine with the no-model
backend (real scheduler, sessions and KV blocks; the logits are a fixed function of token and
position, so greedy outputs do not depend on batching and any difference is a serving bug).
S client sessions loop over LMTP, Salience, Evergreen, GraphPipe, AICI and the OpenAI API,
mixing greedy requests of random lengths, Salience forks, cancels, disconnects mid-stream and
bad requests. Each greedy output is compared with the same protocol's answer to the same
request measured alone before the load started (the single-request reference).

With --hostile N, the second half adds N abusive clients (bench/hostile.py: issue 29's
half-open requests, stalled bodies, connection floods, graph, prompt and grammar bombs, oversized
uploads); the report compares the normal clients' latency there with the quiet first half.

Reported: requests, errors by kind (expected refusals of the bad requests apart), wrong outputs
(must be 0), p50/p99 latency, the process's RSS and the engine's free KV blocks before, during
(max / min) and after (must be back to the idle baseline), open file descriptors before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import numpy as np

from tokenwire.bench import fairness
from tokenwire.bench.hostile import HostileConfig, run_hostile
from tokenwire.bench.inprocess import InProcessServers
from tokenwire.bench.neighbours import busy_neighbours, describe
from tokenwire.bench.random_tokens import RandomTokenModel
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.lmtp import Client, LmtpError
from tokenwire.model.loader import resolve_model
from tokenwire.protocols.evergreen.client import Chat, EvergreenSession, GenerateConfig
from tokenwire.protocols.graphpipe.client import AsyncClient
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.gen import salience_pb2_grpc as pb_grpc
from tokenwire.server import resident_mib

PROMPTS = 12  # reference prompts (token ids); each request takes one and a length up to MAX_NEW
MAX_NEW = 24


def rss_mib() -> float:
    return resident_mib()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Protocols:
    """One greedy request per protocol, as its own client sends it; returns a comparable output."""

    def __init__(self, servers: Any, model: str, http: aiohttp.ClientSession) -> None:
        self.servers = servers
        self.model = model
        self.http = http

    async def lmtp(self, prompt: list[int], n: int) -> Any:
        async with await Client.connect(self.servers.url("lmtp"), model=self.model) as client:
            records = await client.generate_all(prompt, max_tokens=n, temperature=0.0)
        return tuple(r["token"] for r in records if "token" in r)

    async def salience(self, prompt: list[int], n: int, fork_at: int | None = None) -> Any:
        async with grpc.aio.insecure_channel(self.servers.url("grpc")) as channel:
            stub = pb_grpc.SalienceStub(channel)
            sid = (await stub.OpenSession(pb.OpenSessionRequest())).session_id
            try:
                first = n if fork_at is None else fork_at
                # top_k 1: Salience's temperature 0 is the proto default, meaning 1.0
                req = pb.GenerateRequest(
                    session_id=sid, append_tokens=prompt, offset=0, max_tokens=first, top_k=1
                )
                out = [
                    e.token.id
                    async for e in stub.Generate(req)
                    if e.HasField("token") and not e.token.is_prefill
                ]
                if fork_at is None:
                    return tuple(out)
                # fork after the prompt + fork_at tokens, and go on in the fork
                child = (
                    await stub.ForkSession(
                        pb.ForkSessionRequest(session_id=sid, at_position=len(prompt) + fork_at)
                    )
                ).session_id
                try:
                    rest = pb.GenerateRequest(
                        session_id=child, offset=len(prompt) + fork_at, max_tokens=n - fork_at, top_k=1
                    )
                    more = [
                        e.token.id
                        async for e in stub.Generate(rest)
                        if e.HasField("token") and not e.token.is_prefill
                    ]
                finally:
                    await stub.CloseSession(pb.CloseSessionRequest(session_id=child))
                return tuple(out + more)
            finally:
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))

    async def evergreen(self, prompt: list[int], n: int) -> Any:
        session = await EvergreenSession.connect(self.servers.url("grpc"))
        try:
            chat = Chat(session, None, "")
            text = f"prompt {prompt[0]} {prompt[-1]}"
            return "".join([t async for t in chat.say(text, GenerateConfig(max_tokens=n, temperature=0.0))])
        finally:
            await session.close()

    async def graphpipe(self, prompt: list[int], n: int) -> Any:
        async with AsyncClient(self.servers.url("graphpipe")) as client:
            logprobs = await client.execute(
                np.array([prompt], dtype=np.int64), output_name="next_token_logprobs"
            )
        return int(np.asarray(logprobs).reshape(-1).argmax())

    async def aici(self, prompt: list[int], n: int) -> Any:
        body = {"controller": "regex", "controller_arg": f"[a-z]{{1,{n}}}", "prompt": prompt, "max_tokens": n}
        async with self.http.post(self.servers.url("aici") + "/v1/run", json=body) as response:
            raw = await response.text()
            if response.status != 200:
                raise RuntimeError(f"AICI HTTP {response.status}: {raw[:200]}")
        events = [
            json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: ") and x != "data: [DONE]"
        ]
        forks = [f for e in events[1:] for f in e.get("forks", [])]
        errors = [f["error"] for f in forks if f.get("error")]
        if errors:
            raise RuntimeError(f"AICI fork error: {errors[0][:200]}")
        return "".join(f["text"] for f in forks)

    async def openai(self, prompt: list[int], n: int) -> Any:
        body = {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        async with self.http.post(self.servers.url("http") + "/completions", json=body) as response:
            data = await response.json()
            if response.status != 200:
                raise RuntimeError(f"OpenAI HTTP {response.status}: {data}")
        return data["choices"][0]["text"]


PROTOCOLS = ["lmtp", "salience", "evergreen", "graphpipe", "aici", "openai"]


class Soak:
    def __init__(
        self, servers: Any, engine: Any, sessions: int, seconds: float, seed: int, hostile: int = 0
    ) -> None:
        self.servers, self.engine = servers, engine
        self.sessions, self.seconds, self.hostile = sessions, seconds, hostile
        self.rng = random.Random(seed)
        vocab = engine.vocab_size
        self.prompts = [
            [self.rng.randrange(3, vocab) for _ in range(self.rng.randint(3, 40))] for _ in range(PROMPTS)
        ]
        self.reference: dict[tuple[str, int, int], Any] = {}
        self.kinds: Counter[str] = Counter()  # what was done
        self.errors: Counter[str] = Counter()  # unexpected errors by kind
        self.refused: Counter[str] = Counter()  # the bad requests' protocol errors (expected)
        self.wrong: list[str] = []
        self.latencies: list[float] = []
        self.phase_latencies: dict[str, list[float]] = {"quiet": [], "hostile": []}
        self.phase = "quiet"
        self.kv_min = self.rss_max = 0.0

    def _kv_free(self) -> int:
        return int(self.engine.stats()["kv_blocks_available"])

    async def _references(self, p: Protocols) -> None:
        """Each (protocol, prompt, length) request alone, before any load: the expected outputs."""
        for proto in PROTOCOLS:
            for i in range(PROMPTS):
                for n in (1, MAX_NEW // 3, MAX_NEW):
                    self.reference[(proto, i, n)] = await getattr(p, proto)(self.prompts[i], n)

    async def _greedy(self, p: Protocols, rng: random.Random) -> None:
        proto = rng.choice(PROTOCOLS)
        i, n = rng.randrange(PROMPTS), rng.choice((1, MAX_NEW // 3, MAX_NEW))
        if proto == "salience" and n > 2 and rng.random() < 0.5:  # a fork mid-way must continue the same
            self.kinds["salience fork"] += 1
            got = await p.salience(self.prompts[i], n, fork_at=rng.randint(1, n - 1))
        else:
            self.kinds[f"{proto} greedy"] += 1
            got = await getattr(p, proto)(self.prompts[i], n)
        if got != self.reference[(proto, i, n)]:
            self.wrong.append(
                f"{proto} prompt {i} n {n}: {got!r:.80} != {self.reference[(proto, i, n)]!r:.80}"
            )

    async def _cancel_or_vanish(self, p: Protocols, rng: random.Random) -> None:
        """A long generation, abandoned after a few tokens: LMTP CANCEL or a dropped connection
        (LMTP, OpenAI stream, Salience stream)."""
        prompt = self.prompts[rng.randrange(PROMPTS)]
        proto = rng.choice(["lmtp-cancel", "lmtp-drop", "openai-drop", "salience-drop"])
        self.kinds[proto] += 1
        if proto.startswith("lmtp"):
            client = await Client.connect(
                self.servers.url("lmtp"), model=self.engine.name, extensions=["retry"]
            )
            try:
                async for _ in client.generate(prompt, max_tokens=2000, ignore_eos=True):
                    break  # the generator's exit sends CANCEL (retry extension)
            finally:
                if proto == "lmtp-drop":
                    client.transport.ws._response.connection.transport.abort()  # type: ignore[attr-defined]
                await client.close()
        elif proto == "openai-drop":
            body = {
                "model": self.engine.name,
                "prompt": prompt,
                "max_tokens": 2000,
                "stream": True,
                "ignore_eos": True,
            }
            async with self.servers_http.post(
                self.servers.url("http") + "/completions", json=body
            ) as response:
                await response.content.readline()
                response.close()
        else:
            channel = grpc.aio.insecure_channel(self.servers.url("grpc"))
            stub = pb_grpc.SalienceStub(channel)
            sid = (await stub.OpenSession(pb.OpenSessionRequest())).session_id
            call = stub.Generate(
                pb.GenerateRequest(session_id=sid, append_tokens=prompt, offset=0, max_tokens=2000)
            )
            async for _ in call:
                break
            await channel.close()  # gone without a word
            async with grpc.aio.insecure_channel(self.servers.url("grpc")) as again:
                await pb_grpc.SalienceStub(again).CloseSession(pb.CloseSessionRequest(session_id=sid))

    async def _bad(self, p: Protocols, rng: random.Random) -> None:
        """A bad request: it must get the protocol's error, and nothing else breaks."""
        proto = rng.choice(["lmtp", "openai", "graphpipe", "aici", "salience"])
        self.kinds[f"{proto} bad"] += 1
        http = self.servers_http
        if proto == "lmtp":
            async with await Client.connect(self.servers.url("lmtp"), model=self.engine.name) as client:
                try:
                    await client.generate_all([-5, 2**40], max_tokens=2)
                except LmtpError:
                    self.refused["lmtp"] += 1
                    return
        elif proto == "openai":
            async with http.post(
                self.servers.url("http") + "/completions",
                json={"model": self.engine.name, "prompt": "x", "max_tokens": -3},
            ) as r:
                if r.status == 400:
                    self.refused["openai"] += 1
                    return
        elif proto == "graphpipe":
            async with http.post(self.servers.url("graphpipe"), data=os.urandom(64)) as r:
                if r.headers.get("X-GraphPipe-Error-Code"):
                    self.refused["graphpipe"] += 1
                    return
        elif proto == "aici":
            async with http.post(self.servers.url("aici") + "/v1/run", data=b"{oops") as r:
                if r.status == 400:
                    self.refused["aici"] += 1
                    return
        else:
            async with grpc.aio.insecure_channel(self.servers.url("grpc")) as channel:
                try:
                    await pb_grpc.SalienceStub(channel).ForkSession(pb.ForkSessionRequest(session_id="nope"))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                        self.refused["salience"] += 1
                        return
        raise RuntimeError(f"{proto}: a bad request got no protocol error")

    async def _worker(self, p: Protocols, k: int, deadline: float) -> None:
        rng = random.Random(f"{k}")
        while time.monotonic() < deadline:
            r = rng.random()
            op: Callable[[Protocols, random.Random], Awaitable[None]] = (
                self._greedy if r < 0.7 else self._cancel_or_vanish if r < 0.85 else self._bad
            )
            started = time.monotonic()
            try:
                await asyncio.wait_for(op(p, rng), 120)
            except Exception as exc:
                self.errors[f"{op.__name__.strip('_')}: {type(exc).__name__}: {str(exc)[:90]}"] += 1
            self.latencies.append(time.monotonic() - started)
            self.phase_latencies[self.phase].append(self.latencies[-1])

    async def _watch(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.kv_min = min(self.kv_min, self._kv_free())
            self.rss_max = max(self.rss_max, rss_mib())
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:
            self.servers_http = http
            p = Protocols(self.servers, self.engine.name, http)
            await self._references(p)
            await asyncio.sleep(0.5)
            before = {
                "rss_mib": rss_mib(),
                "kv_free": self._kv_free(),
                "fds": open_fds(),
                **_engine(self.engine),
            }
            self.kv_min, self.rss_max = before["kv_free"], before["rss_mib"]
            started = time.monotonic()
            # with hostile clients: a quiet half, then the same normal load beside the abusers
            quiet_s = self.seconds / 2 if self.hostile else self.seconds
            await self._phase(p, started + quiet_s)
            if self.hostile:
                self.phase = "hostile"
                phase_s = started + self.seconds - time.monotonic()
                config = HostileConfig.of(self.servers, self.engine.name, self.hostile, phase_s)
                abusers, _ = await asyncio.gather(run_hostile(config), self._phase(p, started + self.seconds))
            elapsed = time.monotonic() - started
        after = await _settled(self.engine, before)
        lat = sorted(self.latencies)
        return {
            "sessions": self.sessions,
            "seconds": round(elapsed, 1),
            "requests": len(lat),
            "by_kind": dict(sorted(self.kinds.items())),
            "errors": dict(self.errors),
            "refused_bad_requests": dict(self.refused),
            "wrong_outputs": len(self.wrong),
            "wrong_examples": self.wrong[:5],
            "latency_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
            "latency_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "rss_mib": {
                "before": round(before["rss_mib"]),
                "max_during": round(self.rss_max),
                "after": round(after["rss_mib"]),
            },
            "kv_free_blocks": {
                "before": before["kv_free"],
                "min_during": self.kv_min,
                "after": after["kv_free"],
            },
            "engine_after": {k: after[k] for k in ("sessions", "running", "waiting")},
            "engine_before": {k: before[k] for k in ("sessions", "running", "waiting")},
            "fds": {"before": before["fds"], "after": after["fds"]},
            **(_hostile_report(abusers, self.phase_latencies) if self.hostile else {}),
        }

    async def _phase(self, p: Protocols, deadline: float) -> None:
        workers = [self._worker(p, k, deadline) for k in range(self.sessions)]
        await asyncio.gather(self._watch(deadline), *workers)


# normal clients' latency beside the abusers may grow at most this much over the quiet half (issue 29)
HOSTILE_LATENCY_BOUND = 2.0


def _hostile_report(abusers: dict[str, Any], phases: dict[str, list[float]]) -> dict[str, Any]:
    def p(lat: list[float], q: float) -> float:
        lat = sorted(lat)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    ratio = {q: p(phases["hostile"], q) / p(phases["quiet"], q) for q in (0.5, 0.99)}
    return {
        "hostile_acts": abusers["acts"],
        "hostile_errors": abusers["errors"],
        "normal_latency_quiet_ms": {"p50": round(1000 * p(phases["quiet"], 0.5), 1),
                                    "p99": round(1000 * p(phases["quiet"], 0.99), 1)},
        "normal_latency_hostile_ms": {"p50": round(1000 * p(phases["hostile"], 0.5), 1),
                                      "p99": round(1000 * p(phases["hostile"], 0.99), 1)},
        "hostile_latency_ratio": {"p50": round(ratio[0.5], 2), "p99": round(ratio[0.99], 2)},
        "normal_within_2x": ratio[0.5] <= HOSTILE_LATENCY_BOUND,
    }  # fmt: skip


def _engine(engine: Any) -> dict[str, Any]:
    s = engine.stats()
    return {"sessions": s["sessions"], "running": s["running"], "waiting": s["waiting"]}


async def _settled(engine: Any, before: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """The state once the load has drained (KV and sessions back, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        now = {
            "rss_mib": rss_mib(),
            "kv_free": int(engine.stats()["kv_blocks_available"]),
            "fds": open_fds(),
            **_engine(engine),
        }
        if (
            now["kv_free"] >= before["kv_free"]
            and now["sessions"] <= before["sessions"]
            and now["running"] == 0
        ) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def run_soak(args: argparse.Namespace) -> int:
    logging.getLogger("tokenwire").setLevel(logging.ERROR)
    fair = _long_prompt(args) if args.long_prompt else None
    if args.minutes <= 0:
        return 0 if fair is not None else 1
    source = resolve_model(args.model)
    engine = Engine(
        lambda: RandomTokenModel(source.config),
        source.tokenizer,
        name=source.name,
        kv_cache_mb=args.kv_cache_mb,
    )
    engine.source = source  # the AICI runtime tokenizes with the model's own files
    servers = InProcessServers(engine, "--max-sessions", str(max(4096, 4 * args.sessions)), aici=True)
    try:
        soak = Soak(servers, engine, args.sessions, args.minutes * 60, args.seed, hostile=args.hostile)
        with busy_neighbours(args.neighbours):  # the whole soak beside N nice-19 busy loops
            report = asyncio.run(soak.run())
        if args.neighbours:
            report["neighbours"] = describe(args.neighbours)
    finally:
        servers.stop()
        engine.shutdown()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value}")
    ok = (
        report["wrong_outputs"] == 0
        and report["kv_free_blocks"]["after"] >= report["kv_free_blocks"]["before"]
        and report.get("normal_within_2x", True)
        and not report.get("hostile_errors")
    )
    return 0 if ok else 1


def _long_prompt(args: argparse.Namespace) -> dict[str, Any]:
    """bench/fairness.py on the real model: a short prompt's TTFT beside a long one."""
    engine = build_engine(EngineSettings(model=args.model, progress=False, kv_cache_mb=512))
    try:
        report = fairness.measure(engine, args.long_prompt, args.rounds)
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps({"long_prompt": report}, indent=1))
    else:
        fairness.print_table(report)
    return report


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("soak", help="every protocol at once for minutes: errors, wrong outputs, leaks")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--neighbours", type=int, default=0, help="beside N nice-19 busy loops")
    p.add_argument("--sessions", type=int, default=64, help="concurrent client sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hostile", type=int, default=0,
        help="abusive clients (half-open requests, floods, graph and grammar bombs) in the second half",
    )  # fmt: skip
    p.add_argument("--kv-cache-mb", type=float, default=64.0)
    p.add_argument("--model", help="whose tokenizer and vocabulary (default: the default model)")
    p.add_argument(
        "--long-prompt", type=int, default=0, metavar="N",
        help="first, on the real model: a short prompt's time to first token beside an N-token "
        "prompt, fair prefill share vs arrival order (bench/fairness.py); --minutes 0 for only this",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="--long-prompt's interleaved rounds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_soak)
