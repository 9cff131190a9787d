"""`tokenwire serve`: load the model, start the engine and every enabled protocol server.

Each protocol transport listed in SERVE_MODULES offers `add_serve_args(parser)` (its port
flag and options; port 0 turns it off) and `start_from_args(engine, args)`, which starts serving
on --host and returns an async function that stops it (or None when turned off). The process
runs until SIGINT/SIGTERM, then stops the servers in reverse order and then the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
from collections.abc import Awaitable, Callable

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine

log = logging.getLogger("tokenwire.server")

SERVE_MODULES = [
    "tokenwire.protocols.lmtp.ws_server",
    "tokenwire.protocols.grpc_server",
    "tokenwire.protocols.aici.rest",
    "tokenwire.protocols.graphpipe.server",
    "tokenwire.protocols.openai.transport",
]

# A protocol starter: given the engine and the parsed args, start serving and return an
# async function that stops it. Returns None when its port flag turned it off.
Starter = Callable[[Engine, argparse.Namespace], Awaitable[Callable[[], Awaitable[None]] | None]]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    for module in SERVE_MODULES:
        importlib.import_module(module).add_serve_args(parser)


def starters() -> list[Starter]:
    return [importlib.import_module(m).start_from_args for m in SERVE_MODULES]


async def _serve(engine: Engine, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stoppers = []
    for starter in starters():
        stopper = await starter(engine, args)
        if stopper is not None:
            stoppers.append(stopper)
    log.info("tokenwire ready: model %s on %s (%d protocol servers)", engine.name, args.host, len(stoppers))
    await stop.wait()
    log.info("shutting down")
    for stopper in reversed(stoppers):
        await stopper()


def serve(args: argparse.Namespace, settings: EngineSettings) -> int:
    engine = build_engine(settings)
    try:
        asyncio.run(_serve(engine, args))
    finally:
        engine.shutdown()
    log.info("stopped")
    return 0
