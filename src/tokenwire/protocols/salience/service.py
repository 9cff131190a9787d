"""The salience.v1.Salience servicer on the shared grpc.aio server (grpc_server.py).

A thin adapter: each RPC checks the bearer token, asks core.py what to do, calls the engine and
turns engine errors into gRPC statuses (status.py). Sessions live in the engine (tokens, KV,
idle TTL); this servicer only adds what the engine does not know about: image blocks, and which
sessions have a Generate stream open here (a second one is ABORTED at once).
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import EngineError, InvalidRequestError
from tokenwire.engine.request import FinishEvent, Origin, RequestHandle, TokenEvent, stream_events
from tokenwire.engine.session import Ttl
from tokenwire.engine.vision import ImageCounter, ImageInput
from tokenwire.logs import access_log
from tokenwire.protocols.grpc_server import GrpcRegistration
from tokenwire.protocols.salience import core
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.gen import salience_pb2_grpc as pb_grpc
from tokenwire.protocols.salience.images import ImageBlock, VisionTokens
from tokenwire.protocols.salience.status import SalienceStatus, status_for
from tokenwire.protocols.security import bearer, owner_of, token_matches

log = logging.getLogger("tokenwire.salience")

# The vision block tokens of Qwen2-VL-style models; a tokenizer without them has no vision.
VISION_TOKEN_NAMES = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def vision_tokens(engine: EngineAPI) -> VisionTokens | None:
    block = engine.image_block()
    if block is not None:  # a vision model: its config names the tokens
        return VisionTokens(block.start, block.pad, block.end)
    vocab = engine.tokenizer.hf.get_vocab()
    ids = [vocab.get(name) for name in VISION_TOKEN_NAMES]
    if any(i is None for i in ids):
        return None
    return VisionTokens(*ids)  # type: ignore[arg-type]


def model_limits(engine: EngineAPI) -> core.ModelLimits:
    # A text-only model has no pad_count: images are refused (after their ranges are checked)
    # even by a tokenizer that has the vision tokens.
    block = engine.image_block()
    return core.ModelLimits(
        name=engine.name,
        engine=engine.limits,
        vision=vision_tokens(engine),
        pad_count=functools.partial(_pad_count, block.count) if block is not None else None,
    )


def _pad_count(count: ImageCounter, image: ImageBlock) -> int:
    """The vision encoder's token count for an attached image at the model's pixel bounds."""
    try:
        return count(image.data, image.mime or None)  # no mime: sniffed
    except InvalidRequestError as exc:  # not an image mime, corrupt or undecodable bytes
        raise SalienceStatus(
            grpc.StatusCode.INVALID_ARGUMENT, f"image at [{image.start}, {image.end}): {exc}"
        ) from None


def _access_logged(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """One access-log line for a unary RPC that never reaches the engine's request hook
    (Generate's line comes from the engine, by its Origin)."""

    @functools.wraps(method)
    async def logged(self: Any, request: Any, context: Any) -> Any:
        started = time.monotonic()
        outcome = "error"
        try:
            response = await method(self, request, context)
            outcome = "ok"
            return response
        except BaseException:
            code = _code_of(context)
            outcome = code.name if code is not None else "error"
            raise
        finally:
            access_log(
                "salience",
                method.__name__,
                outcome,
                peer=context.peer() if hasattr(context, "peer") else None,
                session=getattr(request, "session_id", None) or None,
                duration_s=time.monotonic() - started,
            )

    return logged


def _code_of(context: Any) -> grpc.StatusCode | None:
    try:
        return context.code()
    except Exception:  # not every context (or grpc version) exposes the code
        return None


class SalienceServicer(pb_grpc.SalienceServicer):
    def __init__(
        self, engine: EngineAPI, *, session_ttl_s: float | None = None, auth_token: str | None = None
    ) -> None:
        self.engine = engine
        self.session_ttl_s = session_ttl_s
        self.limits = model_limits(engine)
        self._auth_token = auth_token or None
        self._images: dict[str, list[ImageBlock]] = {}  # only sessions that hold images
        self._streaming: set[str] = set()  # sessions with a Generate stream open here
        self._handles: dict[str, RequestHandle] = {}  # their engine requests
        self._shutting_down: str | None = None  # the message streams end with, once stopping
        self._opened: set[str] = set()  # sessions this servicer created (closed on shutdown)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _owner(context: grpc.aio.ServicerContext) -> str:
        given = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        return owner_of(bearer(given))

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """The server's interceptor checks every call first (grpc_server.py); this servicer checks
        again by the same rule (security.py: the scheme is case-insensitive, RFC 9110) for a
        server built without it."""
        if self._auth_token is None:
            return
        given = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        if not token_matches(self._auth_token, bearer(given)):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send metadata `authorization: Bearer <token>`",
            )

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
        status = status_for(error) if isinstance(error, EngineError) else error
        assert isinstance(status, SalienceStatus)
        await context.abort(status.code, status.message)

    def _forget_gone_sessions(self) -> None:
        """Drop bookkeeping of sessions the engine no longer has (TTL expiry)."""
        for sid in [s for s in self._opened if not self.engine.has_session(s)]:
            self._opened.discard(sid)
            self._images.pop(sid, None)

    # ------------------------------------------------------------------ lifecycle RPCs
    @_access_logged
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        await self._authorize(context)
        try:
            core.check_model(request.model, self.engine.name)
            self._forget_gone_sessions()
            ttl = Ttl.DEFAULT if self.session_ttl_s is None else self.session_ttl_s
            sid = self.engine.create_session((), ttl_s=ttl)
            self.engine.claim_session(sid, "salience", self._owner(context))  # persists (--state-dir)
        except (SalienceStatus, EngineError) as exc:
            await self._abort(context, exc)
        self._opened.add(sid)
        return pb.OpenSessionResponse(session_id=sid, max_model_len=self.engine.max_model_len)

    @_access_logged
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        await self._authorize(context)
        self.engine.close_session(request.session_id)  # idempotent: False when already gone
        self._opened.discard(request.session_id)
        self._images.pop(request.session_id, None)
        return pb.CloseSessionResponse()

    @_access_logged
    async def ForkSession(self, request: pb.ForkSessionRequest, context: Any) -> pb.ForkSessionResponse:
        await self._authorize(context)
        src = request.session_id
        try:
            length = len(self.engine.session_tokens(src))
            inherited = core.check_fork(request.at_position, length, self._images.get(src, []))
            child = self.engine.fork_session(src, request.at_position)
            self.engine.touch_session(src)
        except (SalienceStatus, EngineError) as exc:
            await self._abort(context, exc)
        self._opened.add(child)
        if inherited:
            self._images[child] = inherited
        return pb.ForkSessionResponse(session_id=child)

    @_access_logged
    async def DumpSession(self, request: pb.DumpSessionRequest, context: Any) -> pb.DumpSessionResponse:
        await self._authorize(context)
        try:
            tokens = self.engine.session_tokens(request.session_id)
            self.engine.touch_session(request.session_id)
        except EngineError as exc:
            await self._abort(context, exc)
        # the proto's response is the tokens only: image blocks travel as trailing metadata
        blocks = self._images.get(request.session_id, [])
        if blocks:
            context.set_trailing_metadata((("salience-image-blocks", core.image_blocks_header(blocks)),))
        return pb.DumpSessionResponse(tokens=tokens)

    @_access_logged
    async def GetReadoutManifest(
        self, request: pb.GetReadoutManifestRequest, context: Any
    ) -> pb.ReadoutManifest:
        await self._authorize(context)
        return core.manifest(self.engine.concepts, self.engine.config.hidden_size)

    # ------------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateEvent]:
        await self._authorize(context)
        sid = request.session_id
        if self._shutting_down is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._shutting_down)
        if sid in self._streaming:
            await context.abort(grpc.StatusCode.ABORTED, f"session {sid} has a Generate running")
        self._streaming.add(sid)
        handle: RequestHandle | None = None
        try:
            try:
                handle, plan = self._start(sid, request, context.peer())
            except (SalienceStatus, EngineError) as exc:
                await self._abort(context, exc)
            if handle is None:
                yield core.done_message(plan.prompt_len, 0, pb.GenerateDone.FINISH_REASON_LENGTH)
                return
            self._handles[sid] = handle
            async for event in stream_events(handle):
                if isinstance(event, TokenEvent):
                    yield core.token_message(event)
                elif isinstance(event, FinishEvent):
                    if event.reason == "cancelled" and self._shutting_down is not None:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, self._shutting_down)
                    if event.reason == "error":
                        # unavailable: the --replicas replica running it died (the client may retry)
                        code = grpc.StatusCode.UNAVAILABLE if event.unavailable else grpc.StatusCode.INTERNAL
                        await context.abort(code, event.error or "generation failed")
                    yield core.finish_message(event)
        finally:
            # A client that cancels the stream lands here (CancelledError at the await above):
            # stop the engine request at once. Tokens decoded so far stay in the session.
            if handle is not None:
                handle.cancel()
            self._handles.pop(sid, None)
            self._streaming.discard(sid)

    def _start(
        self, sid: str, request: pb.GenerateRequest, peer: str | None = None
    ) -> tuple[RequestHandle | None, core.GeneratePlan]:
        """Check, rewind, and submit to the engine. Raises before any change when refused."""
        engine = self.engine
        tokens = engine.session_tokens(sid)
        if engine.session_busy(sid):
            raise SalienceStatus(grpc.StatusCode.ABORTED, f"session {sid} has a request running")
        plan = core.plan_generate(request, tokens, self._images.get(sid, []), self.limits)
        if plan.truncate_to is not None:
            engine.truncate_session(sid, plan.truncate_to)
        if plan.images:
            self._images[sid] = plan.images
        else:
            self._images.pop(sid, None)
        engine.touch_session(sid)
        if plan.options is None:
            return None, plan
        plan.options.origin = Origin("salience", "Generate", peer)
        attached = [
            ImageInput(i.pad_range_start, i.pad_range_end, i.bytes, i.mime or None) for i in request.images
        ]
        return engine.generate(sid, plan.append, plan.options, images=attached), plan

    async def shutdown(self, message: str) -> None:
        """Server stopping: refuse new Generates and end the open ones with UNAVAILABLE(message)
        instead of grpc's bare "Cancelling all calls"."""
        self._shutting_down = message
        for handle in list(self._handles.values()):
            handle.cancel()

    async def close(self) -> None:
        """Server shutdown: release every session this servicer opened, unless the engine keeps
        them for other servers (replicas shared by several ingress processes: a client continues
        through another; its TTL still ends an abandoned one)."""
        if not self.engine.sessions_outlive_server:
            for sid in list(self._opened):
                self.engine.close_session(sid)
        self._opened.clear()
        self._images.clear()


def add_to_server(server: grpc.aio.Server, engine: EngineAPI, args: argparse.Namespace) -> GrpcRegistration:
    servicer = SalienceServicer(
        engine,
        session_ttl_s=getattr(args, "session_ttl", None),
        auth_token=getattr(args, "auth_token", None),
    )
    pb_grpc.add_SalienceServicer_to_server(servicer, server)
    server_names = [pb.DESCRIPTOR.services_by_name["Salience"].full_name]
    return GrpcRegistration(server_names, servicer.close, servicer.shutdown)
