"""`tokenwire evergreen "prompt"`: stream an answer from an Evergreen server; with --chat, keep
reading follow-up turns from stdin (each turn reuses the server's computation of the last)."""

from __future__ import annotations

import argparse
import asyncio
import sys


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("evergreen", help="Evergreen client: stream a GENERATE answer, or chat (--chat)")
    p.add_argument("prompt", nargs="?", help="the first user turn (with --chat: optional)")
    p.add_argument("--server", default="127.0.0.1:50051", help="gRPC address (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="multi-turn: read more turns from stdin, one per line")
    p.add_argument("--system", help="a system turn before the first user turn")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--seed", type=int)
    p.add_argument("--target", default="", help="model name (target_spec.id; default: the server's)")
    p.set_defaults(handler=run_evergreen)


def run_evergreen(args: argparse.Namespace) -> int:
    if args.prompt is None and not args.chat:
        print("tokenwire evergreen: give a prompt, or --chat", file=sys.stderr)
        return 2
    return asyncio.run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    from tokenwire.protocols.evergreen.client import Chat, EvergreenError, EvergreenSession, GenerateConfig

    config = GenerateConfig(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        config.seed = args.seed
    session = await EvergreenSession.connect(args.server)
    chat = Chat(session, args.system)
    try:
        turn = args.prompt
        while True:
            if turn is None:
                print("> ", end="", file=sys.stderr, flush=True)
                turn = await asyncio.to_thread(sys.stdin.readline)
                if not turn:
                    break
                turn = turn.rstrip("\n")
                if not turn:
                    turn = None
                    continue
            async for text in chat.say(turn, config):
                print(text, end="", flush=True)
            print()
            if not args.chat:
                break
            turn = None
    except EvergreenError as exc:
        print(f"\ntokenwire evergreen: {exc}", file=sys.stderr)
        return 1
    finally:
        await session.close()
    return 0
