"""AICI in the `tokenwire` command: the runtime process (`tokenwire aicirt`, also the
`tokenwire-aicirt` script) and `tokenwire serve --aici` (the runtime plus AICI's REST API).

Imported to build the command line: the runtime, the REST server and the engine load when a
command runs.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from tokenwire.cli_args import HelpFormatter
from tokenwire.protocols.aici.runtime_args import add_runtime_args
from tokenwire.protocols.serving import SocketListener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "aicirt",
        help="AICI controller runtime over shared memory (started by the engine)",
        formatter_class=HelpFormatter,
    )
    add_runtime_args(p)
    p.set_defaults(handler=_run_runtime)


def _run_runtime(args: argparse.Namespace) -> int:
    # local: the runtime loads numpy, QuickJS and wasmtime; building the command line needs none
    from tokenwire.protocols.aici.aicirt import run

    return run(args)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("AICI")
    g.add_argument("--aici", action="store_true", help="start the AICI runtime and serve AICI's REST API")
    g.add_argument(
        "--aici-port", type=int, default=4242, help="AICI REST port (default %(default)s; 0 = any)"
    )
    g.add_argument("--aici-store-dir", type=Path, help="where uploaded controllers and tags persist")
    g.add_argument(
        "--aici-runtime-arg", action="append", default=[], help="extra runtime argument (repeatable)"
    )
    g.add_argument(
        "--aici-busy-wait-ms",
        type=float,
        help="ms the runtime spins for the next command (default: 200 when the model runs on a GPU, "
        "0 on the CPU, whose cores the forward needs)",
    )


async def bind(args: argparse.Namespace) -> SocketListener | None:
    if not args.aici:
        return None
    sock = bind_tcp(args.host, args.aici_port, "--aici-port")
    return SocketListener(sock, lambda e, s: _serve(e, s, args))


async def _serve(engine: EngineAPI, sock: socket.socket, args: argparse.Namespace) -> Stopper:
    # local: the REST server loads aiohttp and the engine bridge; `serve --help` needs neither
    from tokenwire.protocols.aici.rest import start_on

    return await start_on(engine, args, sock)
