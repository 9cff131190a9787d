"""GraphPipe in the `tokenwire` command: `tokenwire graphpipe` (describe a model, or run a
request with .npy inputs) and the HTTP server of `tokenwire serve` (--graphpipe-port).

Imported to build the command line: the transport and numpy load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenwire.cli_args import HelpFormatter, unreachable
from tokenwire.protocols.serving import SocketListener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

DEFAULT_PORT = 9000


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "graphpipe",
        help="GraphPipe client: show a model's metadata or run a request",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the GraphPipe server")
    p.add_argument(
        "--model-name",
        default="",
        help="the model's path on the server, e.g. mlp (default: the server's default model)",
    )
    p.add_argument(
        "--input", action="append", default=[], type=Path, help="input tensor as .npy (repeatable)"
    )
    p.add_argument(
        "--input-name", action="append", default=[], help="name of each --input (default: the model's)"
    )
    p.add_argument(
        "--output-name", action="append", default=[], help="outputs to request (default: the model's)"
    )
    p.add_argument("--config", help="config string sent with the request (e.g. JSON)")
    p.add_argument("--save", type=Path, help="write the outputs to this .npz file")
    p.add_argument("--json", action="store_true", help="print outputs (or metadata) as JSON")
    p.set_defaults(handler=run_graphpipe)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    # local: the server loads numpy and aiohttp; `tokenwire --help` does without
    from tokenwire.protocols.graphpipe.server import add_serve_args as graphpipe_args

    graphpipe_args(parser)


async def bind(args: argparse.Namespace) -> SocketListener | None:
    if not args.graphpipe_port:
        return None
    sock = bind_tcp(args.host, args.graphpipe_port, "--graphpipe-port")
    return SocketListener(sock, lambda e, s: _serve(e, s, args))


async def _serve(engine: EngineAPI, sock: socket.socket, args: argparse.Namespace) -> Stopper:
    # local: the server (see add_serve_args)
    from tokenwire.protocols.graphpipe.server import build_server

    server = await build_server(engine, args, args.host, args.graphpipe_port, sock).start()
    return server.stop


def run_graphpipe(args: argparse.Namespace) -> int:
    # local: numpy and the client load for `tokenwire graphpipe` only
    import numpy as np

    from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError
    from tokenwire.protocols.graphpipe.types import type_name

    problem = unreachable(args.url, DEFAULT_PORT)
    if problem is not None:
        print(f"tokenwire graphpipe: {problem}", file=sys.stderr)
        return 1
    url = args.url.rstrip("/") + "/" + args.model_name
    try:
        with Client(url) as client:
            if not args.input:
                meta = client.metadata()
                described = {
                    "name": meta.name,
                    "version": meta.version,
                    "server": meta.server,
                    "description": meta.description,
                    **{
                        kind: [{"name": io.name, "type": type_name(io.type), "shape": io.shape} for io in ios]
                        for kind, ios in (("inputs", meta.inputs), ("outputs", meta.outputs))
                    },
                }
                print(json.dumps(described, indent=1 if args.json else None))
                return 0
            inputs = [np.load(path, allow_pickle=False) for path in args.input]
            outputs = client.execute_multi(
                inputs, args.input_name or None, args.output_name or None, args.config
            )
    except (GraphPipeClientError, OSError, ValueError) as exc:
        code = getattr(exc, "code", None)
        print(f"tokenwire graphpipe: {exc}" + (f" (error code {code})" if code else ""), file=sys.stderr)
        return 1
    names = args.output_name or [f"output_{i}" for i in range(len(outputs))]
    if args.save:
        np.savez(args.save, **dict(zip(names, outputs, strict=False)))
    for name, arr in zip(names, outputs, strict=False):
        if args.json:
            value = (
                arr.tolist()
                if arr.dtype != object
                else [b.decode("utf-8", "replace") for b in arr.reshape(-1)]
            )
            print(
                json.dumps({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape), "value": value})
            )
        else:
            print(f"{name}: {arr.dtype} {list(arr.shape)}\n{arr}")
    return 0
