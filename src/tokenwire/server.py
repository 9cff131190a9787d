"""`tokenwire serve`: bind every enabled protocol's port, load the model, serve, stop cleanly.

Order matters for a user: every flag is checked and every listening port taken before the
model loads, so a mistake or a port clash costs a second, not a model load, and is reported
in one line naming the flag. Then the engine loads (progress in the log) and each protocol
starts on what it bound. On SIGINT/SIGTERM the servers stop in reverse order, each ending its
open streams with its own "server shutting down" error, within --shutdown-grace seconds; the
process then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from tokenwire import plugins
from tokenwire.cli_args import add_model_args, add_state_args, settings_from, state_settings
from tokenwire.config import apply_config_defaults
from tokenwire.heap import freeze_startup_heap
from tokenwire.metrics import bind_metrics, watch_engine
from tokenwire.model_spec import check_model_spec
from tokenwire.protocols.security import ssl_context
from tokenwire.protocols.serving import Listener, PortInUseError, Stopper
from tokenwire.scale.serve import add_scale_args, build_replicated, check_scale_args, shutdown_ray
from tokenwire.shutdown import ShutdownSignals, exit_leaving_model_thread

log = logging.getLogger("tokenwire.server")


def add_serve_args(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    parser.add_argument(
        "--config",
        help="TOML file of serve flags (`kv-cache-mb = 64`); precedence: flag > $TOKENWIRE_<FLAG> > file "
        "> default",
    )
    add_model_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address every protocol binds")
    g.add_argument("--session-ttl", type=float, default=1800.0, help="idle session lifetime, seconds")
    g.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds open streams get to end on SIGTERM"
    )
    g.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics HTTP port (0 = off)")
    add_state_args(parser)  # --state-dir, --no-persist, --state-max-gb (docs/sessions.md)
    add_scale_args(parser)  # --replicas N: engine replicas on Ray (tokenwire/scale)
    for plugin in plugins.SERVER_PLUGINS:
        plugin.add_serve_args(parser)
    apply_config_defaults(parser, argv)


async def _bind_all(args: argparse.Namespace) -> list[Listener]:
    """Every protocol's listener, then the metrics endpoint's (last: it is not a protocol)."""
    listeners: list[Listener] = []
    try:
        for plugin in plugins.SERVER_PLUGINS:
            listener = await plugin.bind(args)
            if listener is not None:
                listeners.append(listener)
        metrics = bind_metrics(args.host, args.metrics_port, ssl_context(args))
        if metrics is not None:
            listeners.append(metrics)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


async def _serve(args: argparse.Namespace) -> int:
    check_model_spec(args.model)
    check_scale_args(args)
    listeners = await _bind_all(args)
    try:
        settings = settings_from(args, session_ttl_s=args.session_ttl, **state_settings(args))
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = ShutdownSignals(loop, stop, args.shutdown_grace)
    # local: the engine (torch) loads after every port is bound: a clash is named at once
    from tokenwire.engine.factory import build_engine

    try:
        if args.replicas:
            engine = await loop.run_in_executor(None, build_replicated, settings, args)
        else:
            engine = await loop.run_in_executor(None, build_engine, settings)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    stoppers: list[Stopper] = []
    try:
        if args.replicas:
            # local: the replicas' metrics load ray's side (facade.py); only --replicas needs them
            from tokenwire.scale.metrics import watch_replicas

            watch_replicas(engine)
        else:
            watch_engine(engine)
        freeze_startup_heap()  # before the first request: heap.py says why
        for listener in listeners:
            stoppers.append(await listener.start(engine))
        protocols = len(stoppers) - (1 if args.metrics_port else 0)
        log.info(
            "tokenwire ready: model %s on %s (%d protocol servers), RSS %.0f MiB",
            engine.name, args.host, protocols, resident_mib(),
        )  # fmt: skip
        await stop.wait()
        log.info("shutting down (grace %.0fs)", args.shutdown_grace)
        await _stop_servers(stoppers, signals.graceful_deadline() - engine_reserve_s(args.shutdown_grace))
    finally:
        engine_stopped = engine.shutdown(timeout_s=max(0.1, signals.graceful_deadline() - time.monotonic()))
        if args.replicas:
            shutdown_ray()
    log.info("stopped")
    if not engine_stopped:  # the interpreter's exit would tear down C++ state under its running step
        exit_leaving_model_thread()
    signals.restore()
    return 0


def engine_reserve_s(grace_s: float) -> float:
    """The part of the grace kept for the model thread to leave its step after the servers stop:
    a stalled client can hold a server's graceful stop to its own timeout (uvicorn's 2 s), and
    the servers stop at once, so the engine still gets its share."""
    return min(2.0, grace_s / 4)


async def _stop_servers(stoppers: list[Stopper], deadline: float) -> None:
    """Every protocol server's graceful stop at once, each ending its streams with its own
    "server shutting down" error; those still stopping at `deadline` are left."""
    tasks = [asyncio.ensure_future(stopper()) for stopper in stoppers]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.1, deadline - time.monotonic()))
    if pending:
        log.warning("%d server(s) did not stop within --shutdown-grace; going on", len(pending))
        for task in pending:
            task.cancel()


def resident_mib() -> float:
    """This process's resident memory now (Linux; 0 where /proc is missing)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_serve(args))
    except PortInUseError as exc:
        print(f"tokenwire serve: {exc.strerror or exc}", file=sys.stderr)
        return 1
