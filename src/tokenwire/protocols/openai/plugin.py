"""The OpenAI-compatible HTTP API in `tokenwire serve` (--http-port).

Imported to build the command line: FastAPI and uvicorn load when `serve` builds its flags.
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import TYPE_CHECKING

from tokenwire.protocols.ollama.listener import DEFAULT_OLLAMA_PORT, with_ollama_port
from tokenwire.protocols.openai.chat_cli import register_cli as chat_cli
from tokenwire.protocols.serving import Listener, SocketListener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`tokenwire chat`: an interactive chat with any OpenAI-compatible server."""
    chat_cli(sub)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI-compatible HTTP API")
    g.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible API port (0 = off)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("TOKENWIRE_API_KEY"),
        help="require Authorization: Bearer KEY on /v1 routes (default: $TOKENWIRE_API_KEY)",
    )
    g.add_argument(
        "--http-max-body-mb",
        type=float,
        default=64.0,
        help="largest request body of this API (413 beyond; docs/limits.md)",
    )
    g.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests waiting in the engine beyond which new ones are refused, on every protocol "
        "(this API: 429)",
    )
    g.add_argument(
        "--ollama-port",
        type=int,
        default=0,
        help=f"also serve Ollama's API (/api/*) on this port (its clients' default: {DEFAULT_OLLAMA_PORT}; "
        "0 = off; docs/ollama.md)",
    )


async def bind(args: argparse.Namespace) -> Listener | None:
    if not args.http_port:
        return with_ollama_port(None, args)  # Ollama's API alone on --ollama-port
    listener = SocketListener(
        bind_tcp(args.host, args.http_port, "--http-port"), lambda e, s: _serve(e, s, args)
    )
    return with_ollama_port(listener, args)


async def _serve(engine: EngineAPI, sock: socket.socket, args: argparse.Namespace) -> Stopper:
    # local: the server loads FastAPI, uvicorn, pydantic and the engine's types; `serve --help` needs none
    from tokenwire.protocols.openai.transport import start_from_args

    stop = await start_from_args(engine, args, sock)
    assert stop is not None
    return stop
