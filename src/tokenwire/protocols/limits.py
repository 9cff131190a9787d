"""The limits flags that apply to every protocol of `tokenwire serve` (docs/limits.md lists
every limit, these and the per-protocol ones).

A server plugin with flags only: `--max-sessions` and `--max-queued` are enforced by the engine
(CapacityError, which each protocol answers as its resource-exhausted error), the others by the
transports that own connections (LMTP's WebSocket server, the gRPC server).
"""

from __future__ import annotations

import argparse

from tokenwire.engine import grammar_guard
from tokenwire.protocols import connection_guard

DEFAULT_MAX_SESSIONS = 4096
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_MAX_STREAMS = 256


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits (every protocol; docs/limits.md)")
    g.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        help="open engine sessions (all protocols) beyond which new ones are refused",
    )
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds an LMTP WebSocket or gRPC connection may stay open with nothing running",
    )
    g.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=DEFAULT_MAX_STREAMS,
        help="concurrent LMTP streams on one WebSocket / concurrent RPCs on one gRPC connection",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=connection_guard.DEFAULT_HEADER_TIMEOUT_S,
        help="seconds an HTTP request line + headers may take to arrive (every HTTP/WebSocket port); "
        "then 408 and closed",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=connection_guard.DEFAULT_BODY_TIMEOUT_S,
        help="seconds an HTTP request body may send nothing; then 408 and closed",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=int,
        default=connection_guard.DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        help="open connections from one client address on each HTTP/WebSocket port; more get 429",
    )
    defaults = grammar_guard.GrammarLimits()
    for name, flag in grammar_guard.FLAGS.items():
        g.add_argument(
            flag,
            type=int,
            default=getattr(defaults, name),
            help=f"every grammar (JSON schema, regex, Lark; every protocol) is refused beyond this many "
            f"{grammar_guard.describe(name)} before it is compiled",
        )


async def bind(args: argparse.Namespace) -> None:
    for flag in (
        "max_sessions",
        "idle_timeout",
        "max_streams_per_connection",
        "header_timeout",
        "body_timeout",
        "max_connections_per_client",
        *(f"grammar_{name}" for name in grammar_guard.FLAGS),
    ):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    connection_guard.configure(
        connection_guard.ConnectionPolicy(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections_per_client=args.max_connections_per_client,
        )
    )
    chosen = {name: getattr(args, f"grammar_{name}") for name in grammar_guard.FLAGS}
    grammar_guard.configure(grammar_guard.GrammarLimits(**chosen))
    return None


def idle_timeout(args: argparse.Namespace) -> float:
    return float(getattr(args, "idle_timeout", DEFAULT_IDLE_TIMEOUT_S))


def max_streams(args: argparse.Namespace) -> int:
    return int(getattr(args, "max_streams_per_connection", DEFAULT_MAX_STREAMS))
