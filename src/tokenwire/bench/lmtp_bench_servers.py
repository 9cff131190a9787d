"""The servers `tokenwire bench lmtp` measures, each run in its own process.

    python -m tokenwire.bench.lmtp_bench_servers echo|random|real --port P

- echo: a bare aiohttp WebSocket server that answers GENERATE with max_tokens TOKEN frames
  as fast as it can (one record a frame, LMQL's record shape): the transport's limit.
- random: tokenwire's LMTP server over the real engine with RandomTokenModel (no forward
  pass): everything but the model, like LMQL's `random` backend.
- real: tokenwire's LMTP server on the default model.
It prints "READY <port>" on stdout once listening, and runs until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

from aiohttp import WSMsgType, web


async def _echo_handler(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(compress=False)
    await ws.prepare(request)
    tasks: set[asyncio.Task[None]] = set()

    async def stream(payload: dict[str, Any]) -> None:
        n = int(payload.get("max_tokens", 32))
        rng = random.Random(payload.get("stream_id", 0))
        for i in range(n):
            record = {
                "token": rng.randrange(49152),
                "stream_id": payload["stream_id"],
                "logprob": -1.0,
                "finish_reason": "length" if i == n - 1 else None,
                "top_logprobs": {},
            }
            await ws.send_str("TOKEN " + json.dumps([record]))

    async for msg in ws:
        if msg.type != WSMsgType.TEXT:
            break
        kind, _, body = msg.data.partition(" ")
        if kind == "GENERATE":
            task = asyncio.ensure_future(stream(json.loads(body)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    return ws


async def _start_echo(port: int) -> tuple[int, Any]:
    app = web.Application()
    app.router.add_get("/", _echo_handler)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return site._server.sockets[0].getsockname()[1], runner.cleanup  # type: ignore[union-attr]


def build_random_engine() -> Any:
    # local: the echo server's process runs without torch, which the engine's modules load
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine
    from tokenwire.model.loader import resolve_model

    source = resolve_model(None)
    return Engine(lambda: RandomTokenModel(source.config), source.tokenizer, name="random", kv_cache_mb=128)


def build_real_engine() -> Any:
    # local: torch (see build_random_engine)
    from tokenwire.engine.factory import EngineSettings, build_engine

    return build_engine(EngineSettings(progress=False, kv_cache_mb=256))


async def _start_lmtp(engine: Any, port: int) -> tuple[int, Any]:
    # local: the LMTP server imports the engine, hence torch (see build_random_engine)
    from tokenwire.protocols.lmtp.ws_server import LmtpServer

    server = await LmtpServer(engine, "127.0.0.1", port).start()
    return server.port, server.stop


async def _main(kind: str, port: int) -> None:
    engine = None
    if kind == "echo":
        bound, stop = await _start_echo(port)
    else:
        engine = build_random_engine() if kind == "random" else build_real_engine()
        bound, stop = await _start_lmtp(engine, port)
    print(f"READY {bound}", flush=True)
    # Run until the benchmark closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await stop()
    if engine is not None:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["echo", "random", "real"])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_main(args.kind, args.port))


if __name__ == "__main__":
    main()
