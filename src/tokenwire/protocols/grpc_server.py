"""The one grpc.aio server of `tokenwire serve`: Salience and Evergreen share its port.

Each gRPC protocol module listed in GRPC_SERVICE_MODULES has
`add_to_server(server, engine, args) -> GrpcRegistration`; this module adds the standard
health service (every registered service reported SERVING, NOT_SERVING while stopping) and
server reflection, so `grpcurl -plaintext HOST:PORT list` shows everything.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenwire.engine.engine import Engine

log = logging.getLogger("tokenwire.grpc")

GRPC_SERVICE_MODULES: list[str] = [
    "tokenwire.protocols.salience.service",
    "tokenwire.protocols.evergreen.servicer",
]

# Big enough for long prompts and readout-heavy streams; gRPC's default is 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class GrpcRegistration:
    """What a protocol module added: its full service names, and how to release its state."""

    service_names: list[str]
    close: Callable[[], Awaitable[None]] | None = None


class GrpcServer:
    """A grpc.aio server with the given protocol modules, health and reflection."""

    def __init__(
        self, engine: Engine, args: argparse.Namespace, host: str, port: int, modules: list[str] | None = None
    ) -> None:
        self.engine = engine
        self.args = args
        self.host = host
        self.requested_port = port
        self.modules = GRPC_SERVICE_MODULES if modules is None else modules
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.registrations: list[GrpcRegistration] = []
        self.health = health.aio.HealthServicer()

    async def start(self) -> GrpcServer:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        for module in self.modules:
            self.registrations.append(
                importlib.import_module(module).add_to_server(server, self.engine, self.args)
            )
        names = [n for r in self.registrations for n in r.service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        address = f"{self.host}:{self.requested_port}"
        credentials = server_credentials(self.args)
        self.port = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
        if self.port == 0:
            raise OSError(f"gRPC: cannot bind {self.host}:{self.requested_port}")
        await server.start()
        for name in ["", *names]:
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        log.info("gRPC on %s:%d: %s", self.host, self.port, ", ".join(names) or "(no services)")
        return self

    async def _set_health(self, name: str, status: int) -> None:
        await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        if self.server is None:
            return
        for name in ["", *(n for r in self.registrations for n in r.service_names)]:
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        for registration in self.registrations:
            if registration.close is not None:
                await registration.close()
        self.server = None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grpc-port", type=int, default=50051, help="gRPC port for Salience and Evergreen (0 = off)"
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("TOKENWIRE_AUTH_TOKEN") or None,
        help="require `authorization: Bearer <token>` on Salience RPCs (default: $TOKENWIRE_AUTH_TOKEN)",
    )
    for module in GRPC_SERVICE_MODULES:  # a service's own options (e.g. Evergreen's --allow-ref-root)
        service_args = getattr(importlib.import_module(module), "add_serve_args", None)
        if service_args is not None:
            service_args(parser)


def server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key, or None for plaintext."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    with open(cert, "rb") as c, open(key, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


async def start_from_args(engine: Engine, args: argparse.Namespace) -> Callable[[], Awaitable[None]] | None:
    port = getattr(args, "grpc_port", 50051)
    if not port or not GRPC_SERVICE_MODULES:
        return None
    server = await GrpcServer(engine, args, getattr(args, "host", "127.0.0.1"), port).start()
    return server.stop
