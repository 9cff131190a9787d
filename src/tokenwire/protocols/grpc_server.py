"""The one grpc.aio server of `tokenwire serve`: Salience and Evergreen share its port.

A gRPC protocol provides `add_to_server(server, engine, args) -> GrpcRegistration`; this
module adds the standard health service (every registered service reported SERVING,
NOT_SERVING while stopping) and server reflection, so `grpcurl -plaintext HOST:PORT list`
shows everything. The port is bound (`bind`) before the model loads, without SO_REUSEPORT,
so a second server on the same port fails at once instead of splitting the clients.

With --auth-token every RPC of the protocol services needs metadata `authorization: Bearer
TOKEN` (BearerAuthInterceptor): without it the call ends UNAUTHENTICATED before the service
sees it. Health and reflection stay open: probes and `grpcurl list` carry no secret.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenwire.protocols.limits import idle_timeout, max_streams
from tokenwire.protocols.security import (
    UNAUTHENTICATED_MESSAGE,
    auth_token,
    bearer,
    refused,
    tls_files,
    token_matches,
)
from tokenwire.protocols.serving import PortInUseError, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.grpc")


class PeerGoneFilter(logging.Filter):
    """grpc.aio logs "ExecuteBatchError raised in core by servicer method [...]" at ERROR, with a
    traceback, when a streamed response is written in the moment between its client leaving and
    grpc noticing (it drops the error itself once it knows the client closed). That is a client's
    disconnect, not a fault: the hostile soak's dropped Salience streams logged 6 such tracebacks
    in 2 minutes, an ERROR flood any client could ask for. Kept as one debug line of ours."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        log.debug("a response to a client that had left was dropped: %s", message[len(self.PREFIX) :].strip())
        return False


_PEER_GONE = PeerGoneFilter()

# Big enough for long prompts and readout-heavy streams; gRPC's default is 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class GrpcRegistration:
    """What a protocol module added: its full service names, and how to release its state."""

    service_names: list[str]
    close: Callable[[], Awaitable[None]] | None = None
    # ends its open streams with the protocol's "server shutting down" error (before the stop)
    shutdown: Callable[[str], Awaitable[None]] | None = None


AddService = Callable[[grpc.aio.Server, "EngineAPI", argparse.Namespace], GrpcRegistration]


class GrpcServer:
    """A grpc.aio server with the given protocol services, health and reflection."""

    def __init__(
        self,
        engine: EngineAPI | None,
        args: argparse.Namespace,
        host: str,
        port: int,
        services: Sequence[AddService] = (),
    ) -> None:
        self.engine = engine
        self.args = args
        self.host = host
        self.requested_port = port
        # the protocols it serves (grpc_plugin.default_services for `tokenwire serve`)
        self.services = list(services)
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.registrations: list[GrpcRegistration] = []
        self.health = health.aio.HealthServicer()

    async def bind(self) -> GrpcServer:
        """Take the port now (credentials read, address checked); serve it in `start`."""
        token = auth_token(self.args)
        logging.getLogger("grpc._cython.cygrpc").addFilter(_PEER_GONE)  # once: a set of filters
        interceptors: list[grpc.aio.ServerInterceptor] = [BearerAuthInterceptor(token)] if token else []
        server = grpc.aio.server(
            interceptors=[*interceptors, DecodeGuardInterceptor()],
            options=self.server_options(),
        )
        address = f"{self.host}:{self.requested_port}"
        if self.requested_port:
            # a plain bind first, for a clean one-line error: grpc's own failure logs a C-core
            # error line to stderr
            bind_tcp(self.host, self.requested_port, "--grpc-port").close()
        credentials = server_credentials(self.args)
        try:
            port = (
                server.add_secure_port(address, credentials)
                if credentials is not None
                else server.add_insecure_port(address)
            )
        except RuntimeError:
            port = 0  # grpc raises "Failed to bind" where older versions returned 0
        if port == 0:
            raise PortInUseError(f"--grpc-port {self.requested_port}: address already in use ({address})")
        self.port, self.server = port, server
        return self

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # grpc's default (1) lets two servers share the port
            # docs/limits.md: RPCs at once on one connection (HTTP/2 streams; more wait for
            # the client's transport), and a connection with no RPC for --idle-timeout closes
            ("grpc.max_concurrent_streams", max_streams(self.args)),
            ("grpc.max_connection_idle_ms", int(idle_timeout(self.args) * 1000)),
        ]

    async def start(self, engine: EngineAPI | None = None) -> GrpcServer:
        if self.server is None:
            await self.bind()
        assert self.server is not None
        self.engine = engine or self.engine
        assert self.engine is not None, "GrpcServer.start needs the engine"
        for add in self.services:
            self.registrations.append(add(self.server, self.engine, self.args))
        names = [n for r in self.registrations for n in r.service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        await self.server.start()
        for name in ["", *names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC on %s:%d: %s", self.host, self.port, ", ".join(names) or "(no services)")
        return self

    async def stop(self, grace: float = 2.0, message: str = "server shutting down") -> None:
        """Stop accepting, end open streams with each protocol's shutdown error, then stop."""
        if self.server is None:
            return
        for name in ["", *(n for r in self.registrations for n in r.service_names)]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for registration in self.registrations:
            if registration.shutdown is not None:
                await registration.shutdown(message)
        await self.server.stop(grace)
        for registration in self.registrations:
            if registration.close is not None:
                await registration.close()
        self.server = None

    def close(self) -> None:
        """Start-up abandoned before `start`: nothing is served; the port goes with the server."""
        self.server = None


def server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key, or None for plaintext."""
    files = tls_files(args)
    if files is None:
        return None
    with open(files[0], "rb") as c, open(files[1], "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


FIRST_MESSAGE_WAIT_S = 5.0


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every protocol RPC needs `authorization: Bearer TOKEN`; health and reflection are open.
    A refused call gets a handler of the same shape that only aborts UNAUTHENTICATED: the
    service's handler never runs and no request is parsed. A request stream's first message is
    taken (raw bytes, dropped) before the abort: refused at once, a client's first write was
    still in flight, and grpc.aio reports such a failed write as INTERNAL, hiding the
    UNAUTHENTICATED (seen once in a full test run: Evergreen's StartSession)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        presented = bearer(given)
        if token_matches(self.token, presented):
            return handler
        method = details.method

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            refused("grpc", context.peer(), method, presented)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        async def deny_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            try:
                await asyncio.wait_for(anext(aiter(requests), None), FIRST_MESSAGE_WAIT_S)
            except (TimeoutError, grpc.RpcError):
                pass  # no first message: refuse anyway
            await deny(requests, context)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny_stream)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _Undecodable:
    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """A request message that does not parse gets INVALID_ARGUMENT naming the message type and
    the parser's reason. grpc's own path answers UNKNOWN ("Exception deserializing request!"),
    which a client cannot act on (reliability-findings.md). Unary requests and bidi streams
    (Evergreen's Session: the bad message ends the stream when the servicer reads it)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming and not handler.response_streaming:
            return handler  # client streaming: no such RPC in our protocols
        parse = handler.request_deserializer
        method = details.method

        def guarded(raw: bytes) -> object:
            try:
                return parse(raw)
            except Exception as exc:  # protobuf's DecodeError and friends
                return _Undecodable(exc)

        async def refuse_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: the request is not a valid message: {request.error}",
                )

        if handler.request_streaming:
            bidi = handler.stream_stream

            async def checked_bidi(requests: AsyncIterator[object], context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
                async def parsed() -> AsyncIterator[object]:
                    async for request in requests:
                        await refuse_undecodable(request, context)
                        yield request

                async for item in _relay(bidi(parsed(), context)):
                    yield item

            return grpc.stream_stream_rpc_method_handler(
                checked_bidi, request_deserializer=guarded, response_serializer=handler.response_serializer
            )
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def checked(request: object, context: grpc.aio.ServicerContext) -> object:
            await refuse_undecodable(request, context)
            return await behavior(request, context)

        async def checked_stream(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await refuse_undecodable(request, context)
            async for item in _relay(behavior(request, context)):
                yield item

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            checked_stream if handler.response_streaming else checked,
            request_deserializer=guarded,
            response_serializer=handler.response_serializer,
        )


async def _relay(result: Any) -> AsyncIterator[object]:
    """A streaming servicer method's answer: an async iterator of responses, or a coroutine that
    writes them through its context."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        await result
