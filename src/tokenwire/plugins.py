"""Every protocol of the `tokenwire` command, listed explicitly (the benchmarks: cli.benchmarks).

A protocol module contributes client or tool subcommands with `register_cli(sub)` and/or a
server of `tokenwire serve` with `add_serve_args(parser)` and `bind(args)` (protocols/serving.py).
Adding a protocol is one import and one list entry here. These modules are light to import
(argparse level): what they serve with loads when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from tokenwire.protocols import grpc_plugin, limits, security
from tokenwire.protocols.aici import plugin as aici
from tokenwire.protocols.evergreen import plugin as evergreen
from tokenwire.protocols.graphpipe import plugin as graphpipe
from tokenwire.protocols.lmtp import plugin as lmtp
from tokenwire.protocols.openai import plugin as openai
from tokenwire.protocols.salience import plugin as salience
from tokenwire.protocols.serving import Listener
from tokenwire.scale import status_cmd as ray_status

SubParsers = argparse._SubParsersAction  # type: ignore[type-arg]


class CliPlugin(Protocol):
    def register_cli(self, sub: SubParsers) -> None: ...


class ServerPlugin(Protocol):
    def add_serve_args(self, parser: argparse.ArgumentParser) -> None: ...

    async def bind(self, args: argparse.Namespace) -> Listener | None: ...


# `tokenwire salience`, `lmtp`, `evergreen`, `graphpipe`, `aicirt`, `chat` (OpenAI-compatible)
CLI_PLUGINS: list[CliPlugin] = [salience, lmtp, evergreen, graphpipe, aici, openai, ray_status]

# what `tokenwire serve` binds and starts, in this order (stopped in reverse); `security` and
# `limits` only add flags for every protocol (--auth-token/--tls-*, --max-sessions...) and check them
SERVER_PLUGINS: list[ServerPlugin] = [security, limits, lmtp, grpc_plugin, aici, graphpipe, openai]
