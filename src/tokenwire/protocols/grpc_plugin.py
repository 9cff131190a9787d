"""The gRPC server of `tokenwire serve`, which Salience and Evergreen share (--grpc-port).

Imported to build the command line: grpc and the services load when the server binds.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tokenwire.protocols.evergreen import plugin as evergreen
from tokenwire.protocols.serving import Stopper

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.protocols.grpc_server import AddService, GrpcServer

DEFAULT_PORT = 50051


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gRPC (Salience and Evergreen)")
    g.add_argument(
        "--grpc-port", type=int, default=DEFAULT_PORT, help="gRPC port for Salience and Evergreen (0 = off)"
    )
    # --tls-cert/--tls-key/--auth-token apply to every protocol: protocols/security.py
    evergreen.add_serve_args(parser)


class _GrpcListener:
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def start(self, engine: EngineAPI) -> Stopper:
        # the services load here, after the port is bound: a clash is named before torch loads
        self.server.services = default_services()
        await self.server.start(engine)
        return self.server.stop

    def close(self) -> None:
        self.server.close()


def default_services() -> list[AddService]:
    """The gRPC protocols `tokenwire serve` runs, in registration order."""
    # local: the servicers load the engine (torch) and their protobuf modules; `serve --help` and
    # the port checks before the model loads do without them
    from tokenwire.protocols.evergreen.servicer import add_to_server as evergreen
    from tokenwire.protocols.salience.service import add_to_server as salience

    return [salience, evergreen]


async def bind(args: argparse.Namespace) -> _GrpcListener | None:
    if not args.grpc_port:
        return None
    # local: grpc's server (grpc's C core), which `serve --help` does without
    from tokenwire.protocols.grpc_server import GrpcServer

    return _GrpcListener(await GrpcServer(None, args, args.host, args.grpc_port).bind())
