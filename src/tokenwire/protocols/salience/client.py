"""Salience clients that track each session's tokens locally (`from tokenwire.salience import Client`).

    async with AsyncClient("127.0.0.1:50051") as client:
        session = await client.open()
        async for token in session.generate(prompt_ids, max_tokens=32, top_k=1):
            ...
        session.truncate(10)            # rewind locally; sent with the next generate
        branch = await session.fork(5)  # shares the server's KV of tokens [0, 5)
        assert await session.verify()   # local tokens == DumpSession

`Client` is the same over a blocking channel. Callers only ever append: offsets and the
truncating flag come from the SessionView (client_session.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from tokenwire.protocols.salience.client_session import GenerateParams, SalienceError, SessionView
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.gen import salience_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


@contextlib.contextmanager
def _generate_call(view: SessionView, call: Any) -> Iterator[None]:
    """Around the iteration of one Generate call (sync or async): a failed RPC becomes a
    SalienceError the view records; a caller that stops iterating (GeneratorExit, task
    cancellation) cancels the call, so the server's work stops now."""
    try:
        yield
    except grpc.RpcError as exc:
        error = SalienceError.from_rpc(exc)
        view.on_error(error)
        raise error from None
    except BaseException:
        call.cancel()
        view.on_cancel()
        raise


def _channel(api: Any, target: str, tls: bool, root_certificates: bytes | None) -> Any:
    """A channel from `api` (grpc or grpc.aio: same constructors), TLS when asked for."""
    if not tls and root_certificates is None:
        return api.insecure_channel(target, options=_OPTIONS)
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return api.secure_channel(target, creds, options=_OPTIONS)


class _SessionState:
    """What both session handles read from their local view (no I/O)."""

    def __init__(self, view: SessionView) -> None:
        self.view = view

    @property
    def id(self) -> str:
        return self.view.session_id

    @property
    def tokens(self) -> list[int]:
        return self.view.tokens

    @property
    def last_done(self) -> pb.GenerateDone | None:
        return self.view.last_done

    def truncate(self, length: int) -> None:
        self.view.truncate(length)


# ---------------------------------------------------------------------------------------- async
class AsyncSession(_SessionState):
    def __init__(self, client: AsyncClient, view: SessionView) -> None:
        super().__init__(view)
        self._client = client

    async def resync(self) -> None:
        self.view.resync(await self.dump())

    async def generate(self, append: Sequence[int] = (), **params: Any) -> AsyncIterator[pb.Token]:
        """Append `append` and stream Token events; `last_done` holds the Done afterwards.
        Keyword arguments are GenerateParams fields (max_tokens, logprobs_ranges, top_k, ...)."""
        if self.view.needs_resync:
            await self.resync()
        request = self.view.request(append, GenerateParams(**params))
        call = self._client.stub.Generate(request, metadata=self._client.metadata)
        with _generate_call(self.view, call):
            async for event in call:
                token = self.view.on_event(event)
                if token is not None:
                    yield token

    async def complete(
        self, append: Sequence[int] = (), **params: Any
    ) -> tuple[list[pb.Token], pb.GenerateDone]:
        tokens = [t async for t in self.generate(append, **params)]
        assert self.view.last_done is not None
        return tokens, self.view.last_done

    async def refresh(self) -> None:
        """The no-op Generate: keeps an idle session from expiring."""
        await self.complete()

    async def fork(self, at: int | None = None) -> AsyncSession:
        at = self.view.length if at is None else at
        reply = await self._client._unary(
            "ForkSession", pb.ForkSessionRequest(session_id=self.id, at_position=at)
        )
        return AsyncSession(self._client, self.view.forked(reply.session_id, at))

    async def dump(self) -> list[int]:
        reply = await self._client._unary("DumpSession", pb.DumpSessionRequest(session_id=self.id))
        return list(reply.tokens)

    async def verify(self) -> bool:
        """True when the local tokens equal the server's session tokens exactly."""
        return await self.dump() == self.view.tokens

    async def close(self) -> None:
        await self._client._unary("CloseSession", pb.CloseSessionRequest(session_id=self.id))


class AsyncClient:
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        auth_token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
    ) -> None:
        self.channel = _channel(grpc.aio, target, tls, root_certificates)
        self.stub = pb_grpc.SalienceStub(self.channel)
        self.metadata = _metadata(auth_token)

    async def _unary(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.stub, method)(request, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise SalienceError.from_rpc(exc) from None

    async def open(self, model: str = "") -> AsyncSession:
        reply = await self._unary("OpenSession", pb.OpenSessionRequest(model=model))
        return AsyncSession(self, SessionView(reply.session_id, reply.max_model_len))

    async def manifest(self) -> pb.ReadoutManifest:
        return await self._unary("GetReadoutManifest", pb.GetReadoutManifestRequest())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ----------------------------------------------------------------------------------------- sync
class Session(_SessionState):
    def __init__(self, client: Client, view: SessionView) -> None:
        super().__init__(view)
        self._client = client

    def resync(self) -> None:
        self.view.resync(self.dump())

    def generate(self, append: Sequence[int] = (), **params: Any) -> Iterator[pb.Token]:
        if self.view.needs_resync:
            self.resync()
        request = self.view.request(append, GenerateParams(**params))
        call = self._client.stub.Generate(request, metadata=self._client.metadata)
        with _generate_call(self.view, call):
            for event in call:
                token = self.view.on_event(event)
                if token is not None:
                    yield token

    def complete(self, append: Sequence[int] = (), **params: Any) -> tuple[list[pb.Token], pb.GenerateDone]:
        tokens = list(self.generate(append, **params))
        assert self.view.last_done is not None
        return tokens, self.view.last_done

    def refresh(self) -> None:
        self.complete()

    def fork(self, at: int | None = None) -> Session:
        at = self.view.length if at is None else at
        reply = self._client._unary("ForkSession", pb.ForkSessionRequest(session_id=self.id, at_position=at))
        return Session(self._client, self.view.forked(reply.session_id, at))

    def dump(self) -> list[int]:
        return list(self._client._unary("DumpSession", pb.DumpSessionRequest(session_id=self.id)).tokens)

    def verify(self) -> bool:
        return self.dump() == self.view.tokens

    def close(self) -> None:
        self._client._unary("CloseSession", pb.CloseSessionRequest(session_id=self.id))


class Client:
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        auth_token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
    ) -> None:
        self.channel = _channel(grpc, target, tls, root_certificates)
        self.stub = pb_grpc.SalienceStub(self.channel)
        self.metadata = _metadata(auth_token)

    def _unary(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise SalienceError.from_rpc(exc) from None

    def open(self, model: str = "") -> Session:
        reply = self._unary("OpenSession", pb.OpenSessionRequest(model=model))
        return Session(self, SessionView(reply.session_id, reply.max_model_len))

    def manifest(self) -> pb.ReadoutManifest:
        return self._unary("GetReadoutManifest", pb.GetReadoutManifestRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
