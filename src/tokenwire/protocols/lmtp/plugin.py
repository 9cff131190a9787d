"""LMTP in the `tokenwire` command: `tokenwire lmtp` (serve on stdin/stdout with --stdio, or
stream a completion from a server) and the WebSocket server of `tokenwire serve` (--lmtp-port).

Imported to build the command line: the transport and the engine load when a command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from typing import TYPE_CHECKING

from tokenwire.cli_args import HelpFormatter, add_model_args, settings_from, unreachable
from tokenwire.protocols.limits import idle_timeout, max_streams
from tokenwire.protocols.security import auth_token, ssl_context
from tokenwire.protocols.serving import SocketListener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.engine.factory import EngineSettings

DEFAULT_PORT = 8080


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "lmtp",
        help="LMTP: serve on stdin/stdout, or stream a completion from a server",
        formatter_class=HelpFormatter,
    )
    p.add_argument("prompt", nargs="?", help="text to complete (client mode)")
    p.add_argument("--stdio", action="store_true", help="serve LMTP on stdin/stdout (loads the model)")
    add_model_args(p)
    g = p.add_argument_group("client")
    g.add_argument("--url", default=f"ws://127.0.0.1:{DEFAULT_PORT}/", help="LMTP server")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print the TOKEN records, one per line")
    p.set_defaults(handler=run_lmtp)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lmtp-port", type=int, default=DEFAULT_PORT, help="LMTP WebSocket port (0 = off)")


async def bind(args: argparse.Namespace) -> SocketListener | None:
    if not args.lmtp_port:
        return None
    return SocketListener(bind_tcp(args.host, args.lmtp_port, "--lmtp-port"), lambda e, s: _serve(e, s, args))


async def _serve(engine: EngineAPI, sock: socket.socket, args: argparse.Namespace) -> Stopper:
    # local: the server imports the engine (torch); `serve --help` does without
    from tokenwire.protocols.lmtp.ws_server import LmtpServer

    server = await LmtpServer(
        engine,
        args.host,
        args.lmtp_port,
        sock=sock,
        auth_token=auth_token(args),
        ssl_context=ssl_context(args),
        idle_timeout_s=idle_timeout(args),
        max_streams=max_streams(args),
    ).start()
    return server.stop


def run_lmtp(args: argparse.Namespace) -> int:
    if args.stdio:
        return _serve_stdio(settings_from(args))
    if args.prompt is None:
        print("tokenwire lmtp: give a prompt, or --stdio to serve", file=sys.stderr)
        return 2
    problem = unreachable(args.url, DEFAULT_PORT)
    if problem is not None:
        print(f"tokenwire lmtp: {problem}", file=sys.stderr)
        return 1
    return asyncio.run(_complete(args))


def _serve_stdio(settings: EngineSettings) -> int:
    # local: the engine (torch) loads only for `tokenwire lmtp --stdio`
    from tokenwire.engine.factory import build_engine
    from tokenwire.protocols.lmtp.stdio import serve_stdio

    engine = asyncio.run(serve_stdio(lambda: build_engine(settings)))
    if engine is not None:
        engine.shutdown()
    return 0


async def _complete(args: argparse.Namespace) -> int:
    # local: aiohttp loads for `tokenwire lmtp` only
    from tokenwire.protocols.lmtp.client import Client, LmtpError

    extra = {"seed": args.seed} if args.seed is not None else {}
    try:
        async with await Client.connect(args.url, extensions=["text"]) as client:
            async for record in client.generate(
                args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, **extra
            ):
                if args.json:
                    print(json.dumps(record, ensure_ascii=False), flush=True)
                else:
                    print(record.get("text", ""), end="", flush=True)
    except (LmtpError, OSError) as exc:
        print(f"\ntokenwire lmtp: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print()
    return 0
