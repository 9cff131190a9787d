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
    from tokenwire.protocols.aici.aicirt import run

    return run(args)


# flags later AICI engines pass; accepted so any of them can start this runtime
_CAPABILITY_FLAGS = [
    "--futex",
    "--restricted",
    "--wasm-timer-resolution-us",
    "--wasm-max-memory",
    "--wasm-max-pre-step-time",
    "--wasm-max-step-time",
    "--wasm-max-init-time",
    "--wasm-max-timeout-steps",
    "--cap-backtrack",
    "--cap-ff-tokens",
    "--cap-fork",
    "--shm-prefix",
    "--module-upload",
    "--bench",
    "--save-tokenizer",
    "--add-tokens",
    "--json-size-mb",
]


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default="default",
        help="'default' (SmolLM2), a served model name, a model dir, .gguf or tokenizer.json",
    )
    p.add_argument("--json-size", type=int, default=128, help="MiB of each JSON channel (engine-created)")
    p.add_argument("--bin-size", type=int, default=128, help="MiB of the bias region (engine-created)")
    p.add_argument("--name", default="/aici0-", help="shared memory prefix (default %(default)s)")
    p.add_argument("--server", action="store_true", help="serve the channels (aicirt compatibility)")
    p.add_argument(
        "--store-dir",
        type=Path,
        default=Path.home() / ".cache" / "tokenwire" / "aici",
        help="where uploaded modules and tags persist (default %(default)s)",
    )
    p.add_argument("--max-pre-ms", type=float, default=1.0, help="pre_process time limit")
    p.add_argument("--max-post-ms", type=float, default=1.0, help="post_process time limit")
    p.add_argument("--max-mid-ms", type=float, default=20.0, help="mid_process time limit")
    p.add_argument("--max-init-ms", type=float, default=1000.0, help="instantiate time limit")
    p.add_argument(
        "--time-tolerance-ms",
        type=float,
        default=5.0,
        help="scheduling slack added to every limit (a shared CPU preempts)",
    )
    p.add_argument("--max-memory-mb", type=float, default=64.0, help="memory per jsctrl/Wasm controller")
    p.add_argument(
        "--busy-wait-time",
        type=float,
        default=200.0,
        help="ms to spin for the next main-channel command before sleeping (AICI's default; "
        "0 when the engine computes on the same CPU cores)",
    )
    p.add_argument("--side-workers", type=int, default=2, help="threads serving the side channel")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="exit when the process that started this runtime is gone (tokenwire's engines pass it)",
    )
    for flag in _CAPABILITY_FLAGS:
        p.add_argument(flag, nargs="?", const="1", default=None, help=argparse.SUPPRESS)


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
    from tokenwire.protocols.aici.rest import start_on

    return await start_on(engine, args, sock)
