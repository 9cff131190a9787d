"""`tokenwire serve`: load the model, start the engine and every enabled protocol server.

Protocol servers register here as they are built (each on its own port flag, bound to
--host). The process runs until SIGINT/SIGTERM, then stops the servers and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine

log = logging.getLogger("tokenwire.server")

# A protocol starter: given the engine and the parsed args, start serving and return an
# async function that stops it. Returns None when its port flag turned it off.
Starter = Callable[[Engine, argparse.Namespace], Awaitable[Callable[[], Awaitable[None]] | None]]
STARTERS: list[Starter] = []


def _register_starters() -> None:
    from tokenwire.protocols.lmtp.ws_server import start_from_args as start_lmtp

    STARTERS.append(start_lmtp)


_register_starters()


async def _serve(engine: Engine, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stoppers = []
    for starter in STARTERS:
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
