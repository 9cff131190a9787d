"""`tokenwire lmtp`: serve LMTP on stdin/stdout (--stdio), or stream a completion from a server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tokenwire.engine.factory import EngineSettings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tokenwire.cli import add_model_args, settings_from

    p = sub.add_parser("lmtp", help="LMTP: serve on stdin/stdout, or stream a completion from a server")
    p.add_argument("prompt", nargs="?", help="text to complete (client mode)")
    p.add_argument("--stdio", action="store_true", help="serve LMTP on stdin/stdout (loads the model)")
    add_model_args(p)
    g = p.add_argument_group("client")
    g.add_argument("--url", default="ws://127.0.0.1:8080/", help="LMTP server (default %(default)s)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print the TOKEN records, one per line")
    p.set_defaults(handler=lambda args: run_lmtp(args, settings_from(args)))


def run_lmtp(args: argparse.Namespace, settings: EngineSettings) -> int:
    if args.stdio:
        return _serve_stdio(settings)
    if args.prompt is None:
        print("tokenwire lmtp: give a prompt, or --stdio to serve", file=sys.stderr)
        return 2
    return asyncio.run(_complete(args))


def _serve_stdio(settings: EngineSettings) -> int:
    from tokenwire.engine.factory import build_engine
    from tokenwire.protocols.lmtp.stdio import serve_stdio

    engine = asyncio.run(serve_stdio(lambda: build_engine(settings)))
    if engine is not None:
        engine.shutdown()
    return 0


async def _complete(args: argparse.Namespace) -> int:
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
