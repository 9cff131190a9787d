"""The limits flags that apply to every protocol of `tokenwire serve` (docs/limits.md lists
every limit, these and the per-protocol ones).

A server plugin with flags only: `--max-sessions` and `--max-queued` are enforced by the engine
(CapacityError, which each protocol answers as its resource-exhausted error), the others by the
transports that own connections (LMTP's WebSocket server, the gRPC server).
"""

from __future__ import annotations

import argparse

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


async def bind(args: argparse.Namespace) -> None:
    for flag in ("max_sessions", "idle_timeout", "max_streams_per_connection"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    return None


def idle_timeout(args: argparse.Namespace) -> float:
    return float(getattr(args, "idle_timeout", DEFAULT_IDLE_TIMEOUT_S))


def max_streams(args: argparse.Namespace) -> int:
    return int(getattr(args, "max_streams_per_connection", DEFAULT_MAX_STREAMS))
