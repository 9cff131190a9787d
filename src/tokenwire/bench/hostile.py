"""Abusive clients for the soak's hostile phase (`tokenwire bench soak --hostile N`): each of
issue 29's classes, over and over, beside the normal clients.

They run in a process of their own (`python -m tokenwire.bench.hostile CONFIG`), as abusers
do: their own cost (building a 20 MB upload, a 3 MB prompt) is not charged to the server's
interpreter, only the server's work for them is. Every hostile client connects from a loopback
address of its own where the protocol lets it choose (127.0.0.2, 127.0.0.3, ...: Linux routes
all of 127/8 to lo), so the per-address connection cap it runs into is its own and the normal
clients on 127.0.0.1 keep theirs. Each act has an expected answer — the protocol's refusal, or
the connection closed by its deadline — and anything else (a 500, a hang past the deadline, a
normal answer to a bomb) is counted as an error of the soak.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import grpc

from tokenwire.lmtp import Client, LmtpError
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc

# the shapes of issue 29's findings
DIAMOND_DEPTH = 30  # d0..d29 each listing d{i+1} twice: 31 nodes, 2^30 chunks
HUGE_PROMPT_IDS = 10**6
REGEX_BOMB = "(a|aa)*" * 50 + "b{1000000}"
OVERSIZED_UPLOAD = 20 * 2**20  # past the AICI REST upload cap (16 MiB)
HTTP_PORTS = ("http", "graphpipe", "aici", "lmtp")
KINDS = (
    "half_open", "stalled_body", "connection_flood", "evergreen_diamond", "lmtp_huge_prompt",
    "openai_regex_bomb", "aici_oversized_upload",
)  # fmt: skip


@dataclass
class HostileConfig:
    """What the abusers' process needs to know of the servers (JSON on its command line)."""

    ports: dict[str, int]
    model: str
    header_timeout: float
    body_timeout: float
    per_client: int
    aici: bool
    count: int
    seconds: float
    kinds: list[str] = field(default_factory=lambda: list(KINDS))

    @classmethod
    def of(cls, servers: Any, model: str, count: int, seconds: float) -> HostileConfig:
        args = servers.args
        return cls(
            dict(servers.ports), model, float(args.header_timeout), float(args.body_timeout),
            int(args.max_connections_per_client), bool(getattr(args, "aici", False)), count, seconds,
        )  # fmt: skip


async def run_hostile(config: HostileConfig) -> dict[str, dict[str, int]]:
    """The abusers for `config.seconds`, in a child process; what they did and what went wrong."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenwire.bench.hostile", json.dumps(asdict(config)),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    if child.returncode != 0:
        return {"acts": {}, "errors": {f"hostile process exited {child.returncode}": 1}}
    return json.loads(out)


class HostileClients:
    """`config.count` abusive clients; `acts` counts what they did, `errors` what went wrong."""

    def __init__(self, config: HostileConfig) -> None:
        self.config = config
        self.act_timeout = config.header_timeout + config.body_timeout + 30
        self.acts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    async def run(self) -> None:
        deadline = time.monotonic() + self.config.seconds
        await asyncio.gather(*(self._client(k, deadline) for k in range(self.config.count)))

    async def _client(self, k: int, deadline: float) -> None:
        rng = random.Random(f"hostile {k}")
        address = f"127.0.0.{2 + k % 250}"
        acts = [getattr(self, kind) for kind in self.config.kinds]
        while time.monotonic() < deadline:
            act = rng.choice(acts)
            name = act.__name__
            self.acts[name] += 1
            try:
                problem = await asyncio.wait_for(act(address, rng), self.act_timeout)
            except Exception as exc:  # every escape is a finding of the soak
                problem = f"{type(exc).__name__}: {str(exc)[:80]}"
            if problem:
                self.errors[f"hostile {name}: {problem}"] += 1

    def url(self, name: str) -> str:
        port = self.config.ports[name]
        return {
            "lmtp": f"ws://127.0.0.1:{port}/", "grpc": f"127.0.0.1:{port}",
            "http": f"http://127.0.0.1:{port}/v1", "aici": f"http://127.0.0.1:{port}",
        }[name]  # fmt: skip

    # ------------------------------------------------------------ connections that never finish

    async def _open(self, port_name: str, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        port = self.config.ports[port_name]
        return await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))

    async def _closed_by_server(self, reader: asyncio.StreamReader, within: float) -> bytes | None:
        """What the server sent before closing, or None when it kept the connection past `within`."""
        try:
            return await asyncio.wait_for(reader.read(-1), within)
        except TimeoutError:
            return None

    async def half_open(self, address: str, rng: random.Random) -> str:
        """The finding: a request line and some headers, then nothing."""
        port = rng.choice(HTTP_PORTS)
        reader, writer = await self._open(port, address)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            answer = await self._closed_by_server(reader, self.config.header_timeout + 5)
            return "" if answer is not None else f"{port}: still open after the header deadline"
        finally:
            writer.close()

    async def stalled_body(self, address: str, rng: random.Random) -> str:
        port, path = rng.choice((("http", b"/v1/completions"), ("graphpipe", b"/"), ("aici", b"/v1/run")))
        reader, writer = await self._open(port, address)
        try:
            writer.write(b'POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model"' % path)
            answer = await self._closed_by_server(reader, self.config.body_timeout + 5)
            if answer is None:
                return f"{port}: still open after the body deadline"
            status = answer.split(b"\r\n", 1)[0]
            return "" if b" 408 " in status else f"{port}: {status[:40]!r} instead of 408"
        finally:
            writer.close()

    async def connection_flood(self, address: str, rng: random.Random) -> str:
        """More connections from one address than the cap: the extra ones are refused."""
        port = rng.choice(HTTP_PORTS)
        opened = []
        try:
            for _ in range(self.config.per_client + 4):
                opened.append(await self._open(port, address))
            refused = 0
            for reader, _writer in opened[self.config.per_client :]:
                answer = await self._closed_by_server(reader, 5)
                refused += answer is not None
            return "" if refused == 4 else f"{port}: {4 - refused} connections over the cap were kept"
        finally:
            for _reader, writer in opened:
                writer.close()

    # ------------------------------------------------------------ small messages, large work

    async def evergreen_diamond(self, address: str, rng: random.Random) -> str:
        leaf = pb.Chunk(data=b"x")
        leaf.metadata.mimetype = "text/plain"
        fragments = [pb.NodeFragment(id=f"d{i}", child_ids=[f"d{i + 1}"] * 2) for i in range(DIAMOND_DEPTH)]
        fragments.append(pb.NodeFragment(id=f"d{DIAMOND_DEPTH}", chunk_fragment=leaf))
        action = pb.Action(
            name=rng.choice(["GENERATE", "COUNT_TOKENS"]),
            inputs=[pb.NamedParameter(name="prompt", id="d0")],
        )
        action.outputs.add(name="response" if action.name == "GENERATE" else "count", id="out")
        async with grpc.aio.insecure_channel(self.url("grpc")) as channel:
            call = spb_grpc.EvergreenServiceStub(channel).StartSession()
            await call.write(spb.SessionMessage(node_fragments=fragments, actions=[action]))
            try:
                async for _reply in call:
                    return "a 2^30-chunk prompt was answered"
            except grpc.aio.AioRpcError as exc:
                return "" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else f"{exc.code().name}"
        return "the session ended without the resource error"

    async def lmtp_huge_prompt(self, address: str, rng: random.Random) -> str:
        async with await Client.connect(self.url("lmtp"), model=self.config.model) as client:
            try:
                await client.generate_all([rng.randrange(3, 1000)] * HUGE_PROMPT_IDS, max_tokens=1)
            except LmtpError:
                return ""
        return "a 10^6-token prompt was answered"

    async def openai_regex_bomb(self, address: str, rng: random.Random) -> str:
        body = {"model": self.config.model, "prompt": "x", "max_tokens": 8, "regex": REGEX_BOMB}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0))) as http:
            async with http.post(self.url("http") + "/completions", json=body) as r:
                await r.read()
                return "" if r.status in (200, 400) else f"HTTP {r.status}"

    async def aici_oversized_upload(self, address: str, rng: random.Random) -> str:
        if not self.config.aici:
            return ""
        data = os.urandom(1024) * (OVERSIZED_UPLOAD // 1024)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0))) as http:
            async with http.post(self.url("aici") + "/v1/controllers", data=data) as r:
                text = await r.text()
                return "" if r.status == 413 else f"HTTP {r.status}: {text[:60]}"


def main(argv: list[str]) -> int:
    config = HostileConfig(**json.loads(argv[0]))
    clients = HostileClients(config)
    asyncio.run(clients.run())
    print(json.dumps({"acts": dict(sorted(clients.acts.items())), "errors": dict(clients.errors)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
