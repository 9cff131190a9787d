"""Every protocol and benchmark of the `tokenwire` command, listed explicitly.

A protocol module contributes client or tool subcommands with `register_cli(sub)` and/or a
server of `tokenwire serve` with `add_serve_args(parser)` and `bind(args)` (protocols/serving.py).
Adding a protocol is one import and one list entry here. These modules are light to import
(argparse level): what they serve with loads when a command runs.
"""

from __future__ import annotations

import argparse
from types import ModuleType
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


def benchmarks() -> list[ModuleType]:
    """`tokenwire bench NAME`: each module has `register(sub)`. Imported only for `bench`:
    they import the engine and the protocols' clients."""
    from tokenwire.bench import (
        aici_bench,
        engine_bench,
        evergreen_bench,
        fuzz_bench,
        graphpipe_bench,
        lmtp_bench,
        openai_bench,
        salience_bench,
        scale_bench,
        soak_bench,
        vision_bench,
    )

    return [
        salience_bench, engine_bench, graphpipe_bench, lmtp_bench, evergreen_bench, aici_bench, openai_bench,
        vision_bench, scale_bench, fuzz_bench, soak_bench,
    ]  # fmt: skip
