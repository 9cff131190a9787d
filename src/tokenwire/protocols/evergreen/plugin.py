"""`tokenwire evergreen "prompt"`: stream an answer from an Evergreen server; with --chat, keep
reading follow-up turns from stdin (each turn reuses the server's computation of the last)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from tokenwire.cli_args import HelpFormatter, unreachable

DEFAULT_URL = "127.0.0.1:50051"


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "evergreen",
        help="Evergreen client: stream a GENERATE answer, or chat (--chat)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("prompt", nargs="?", help="the first user turn (with --chat: optional)")
    p.add_argument("--url", default=DEFAULT_URL, help="the server's gRPC address (HOST:PORT)")
    p.add_argument("--chat", action="store_true", help="multi-turn: read more turns from stdin, one per line")
    p.add_argument("--system", help="a system turn before the first user turn")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--model-name", default="", help="model name (target_spec.id; default: the server's)")
    p.set_defaults(handler=run_evergreen)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evergreen")
    g.add_argument(
        "--allow-ref-root",
        action="append",
        default=[],
        metavar="DIR",
        help="Evergreen: read file:// refs under this directory (repeatable; none by default)",
    )
    # local: grpc and protobuf load with the server, not for `tokenwire --help`
    from tokenwire.protocols.evergreen.nodes import DEFAULT_MAX_TOKENS, SessionLimits

    d = SessionLimits()
    g.add_argument("--evergreen-max-depth", type=int, default=d.max_depth, help="node nesting depth limit")
    g.add_argument("--evergreen-max-nodes", type=int, default=d.max_nodes, help="nodes per session")
    g.add_argument("--evergreen-max-bytes", type=int, default=d.max_bytes, help="bytes per session")
    g.add_argument("--evergreen-max-actions", type=int, default=d.max_actions, help="actions per session")
    g.add_argument(
        "--evergreen-max-flattened-chunks",
        type=int,
        default=d.max_flattened_chunks,
        help="chunks one action input may flatten to (shared nodes counted each time they are used)",
    )
    g.add_argument(
        "--evergreen-max-edges",
        type=int,
        default=d.max_edges,
        help="child ids all of a session's nodes may list (bounds the cycle and depth bookkeeping)",
    )
    g.add_argument(
        "--evergreen-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="GENERATE's max_tokens when its GenerateConfig sets none",
    )
    g.add_argument(
        "--evergreen-no-reuse",
        dest="evergreen_reuse",
        action="store_false",
        help="benchmarks/debugging: never extend earlier engine sessions, prefix cache off",
    )


def run_evergreen(args: argparse.Namespace) -> int:
    if args.prompt is None and not args.chat:
        print("tokenwire evergreen: give a prompt, or --chat", file=sys.stderr)
        return 2
    problem = unreachable(args.url, 50051)
    if problem is not None:
        print(f"tokenwire evergreen: {problem}", file=sys.stderr)
        return 1
    return asyncio.run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    # local: the client loads the engine's types (torch) and grpc; only `tokenwire evergreen` needs them
    from tokenwire.protocols.evergreen.client import Chat, EvergreenError, EvergreenSession, GenerateConfig

    config = GenerateConfig(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        config.seed = args.seed
    session = await EvergreenSession.connect(args.url)
    chat = Chat(session, args.system, args.model_name)
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
