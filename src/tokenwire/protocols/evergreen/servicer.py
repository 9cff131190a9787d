"""The thin grpc.aio adapter: `/evergreen.v2.EvergreenService/StartSession` on the shared server.

One SessionRunner per RPC. Client messages feed it; its outgoing messages are written back;
an abort becomes the RPC's status (code + message naming the node/action and the rule).
When the client closes its side the running actions finish, then the RPC ends OK; when the
client cancels, everything of the session is released.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tokenwire.engine.api import EngineAPI
from tokenwire.protocols.evergreen.content import ChatLayout, PromptBuilder, vision_block
from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.executor import DEFAULT_MAX_TOKENS
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc
from tokenwire.protocols.evergreen.nodes import SessionLimits
from tokenwire.protocols.evergreen.refs import RefSandbox
from tokenwire.protocols.evergreen.runner import SessionRunner
from tokenwire.protocols.grpc_server import GrpcRegistration

log = logging.getLogger("tokenwire.evergreen")
SERVICE_NAME = "evergreen.v2.EvergreenService"


class EvergreenServicer(spb_grpc.EvergreenServiceServicer):
    def __init__(
        self,
        engine: EngineAPI,
        sandbox: RefSandbox,
        limits: SessionLimits | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        reuse: bool = True,
    ) -> None:
        self.engine = engine
        self.reuse = reuse
        self.default_max_tokens = default_max_tokens
        self.sandbox = sandbox
        self.limits = limits or SessionLimits()
        self.layout = ChatLayout.from_tokenizer(engine.tokenizer)
        self.runners: set[SessionRunner] = set()

    def new_runner(self) -> SessionRunner:
        builder = PromptBuilder(self.engine.tokenizer, self.layout, vision_block(self.engine))
        return SessionRunner(
            self.engine, builder, self.sandbox, self.limits, self.default_max_tokens, reuse=self.reuse
        )

    async def StartSession(
        self, request_iterator: AsyncIterator[spb.SessionMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.SessionMessage]:
        runner = self.new_runner()
        self.runners.add(runner)
        reader = asyncio.create_task(self._read(request_iterator, runner))
        try:
            while True:
                if runner.finished:
                    return
                item = await runner.next_message()
                if isinstance(item, SessionAbort):
                    log.info("evergreen session aborted: %s %s", item.code.name, item.message)
                    await context.abort(item.code, item.message)
                if isinstance(item, spb.SessionMessage):
                    yield item
        finally:
            # The reader is not cancelled here: cancelling a pending read while the abort
            # status is on its way can make the client see INTERNAL instead of that status.
            # It ends by itself when the call ends (or at its next message, after a failure).
            reader.add_done_callback(_consume_result)
            await runner.close()
            self.runners.discard(runner)

    @staticmethod
    async def _read(request_iterator: AsyncIterator[spb.SessionMessage], runner: SessionRunner) -> None:
        try:
            async for message in request_iterator:
                runner.feed(message)
                if runner.failure is not None:
                    return
        finally:
            runner.close_input()

    async def shutdown(self, message: str, wait_s: float = 2.0) -> None:
        """Server stopping: every open session ends with UNAVAILABLE(message), its in-flight
        actions cancelled, before grpc's own stop would cancel the calls bare."""
        for runner in list(self.runners):
            runner.abort(SessionAbort(grpc.StatusCode.UNAVAILABLE, message))
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.runners and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)  # each StartSession sends its status and leaves the set

    async def close(self) -> None:
        for runner in list(self.runners):
            runner.abort(SessionAbort(grpc.StatusCode.UNAVAILABLE, "server shutting down"))
            await runner.close()


def _consume_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("evergreen reader ended: %r", task.exception())


def limits_from_args(args: argparse.Namespace) -> SessionLimits:
    d = SessionLimits()
    return SessionLimits(
        max_depth=getattr(args, "evergreen_max_depth", None) or d.max_depth,
        max_nodes=getattr(args, "evergreen_max_nodes", None) or d.max_nodes,
        max_bytes=getattr(args, "evergreen_max_bytes", None) or d.max_bytes,
        max_actions=getattr(args, "evergreen_max_actions", None) or d.max_actions,
        max_flattened_chunks=getattr(args, "evergreen_max_flattened_chunks", None) or d.max_flattened_chunks,
        max_edges=getattr(args, "evergreen_max_edges", None) or d.max_edges,
    )


def add_to_server(server: grpc.aio.Server, engine: EngineAPI, args: argparse.Namespace) -> GrpcRegistration:
    sandbox = RefSandbox(getattr(args, "allow_ref_root", None) or [])
    max_tokens = getattr(args, "evergreen_max_tokens", None) or DEFAULT_MAX_TOKENS
    reuse = getattr(args, "evergreen_reuse", True)
    servicer = EvergreenServicer(engine, sandbox, limits_from_args(args), max_tokens, reuse=reuse)
    spb_grpc.add_EvergreenServiceServicer_to_server(servicer, server)
    return GrpcRegistration([SERVICE_NAME], servicer.close, servicer.shutdown)
