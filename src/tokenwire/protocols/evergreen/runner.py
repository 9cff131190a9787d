"""One live Evergreen session on asyncio: feeds the sans-IO core, runs actions as tasks,
queues outgoing SessionMessages. Transport-independent (servicer.py is the gRPC adapter)."""

from __future__ import annotations

import asyncio
import codecs
import logging

import grpc

from tokenwire.engine.api import EngineAPI
from tokenwire.protocols.evergreen.content import PromptBuilder, is_text
from tokenwire.protocols.evergreen.core import ActionState, Effects, SessionCore
from tokenwire.protocols.evergreen.engine_sessions import EngineSessions
from tokenwire.protocols.evergreen.errors import SessionAbort, exhausted, invalid
from tokenwire.protocols.evergreen.executor import DEFAULT_MAX_TOKENS, run_action
from tokenwire.protocols.evergreen.flatten import Flattened, Ref
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.nodes import SessionLimits
from tokenwire.protocols.evergreen.refs import RefSandbox

log = logging.getLogger("tokenwire.evergreen")
MAX_FRAGMENTS_PER_MESSAGE = 256

# a batch of fragments to send, an abort, or None: "check whether the session is over"
Outgoing = list[pb.NodeFragment] | SessionAbort | None


class InputClosed(Exception):
    """The client closed its stream while an action still waits for input."""


class SessionRunner:
    def __init__(
        self,
        engine: EngineAPI,
        builder: PromptBuilder,
        sandbox: RefSandbox,
        limits: SessionLimits | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        reuse: bool = True,
    ) -> None:
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.builder = builder
        self.sandbox = sandbox
        self.core = SessionCore({engine.name}, limits)
        self.pool = EngineSessions(engine, reuse=reuse)
        self.version = 0
        self._changed = asyncio.Event()
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.tasks: dict[ActionState, asyncio.Task[None]] = {}
        self.failure: SessionAbort | None = None
        self.input_closed = False
        self._ttl_timer: asyncio.TimerHandle | None = None
        self._texts: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._text_bytes: dict[str, int] = {}  # a text ref's size in bytes

    # ------------------------------------------------------------------ intake
    def feed(self, message: spb.SessionMessage) -> None:
        if self.failure is not None:
            return
        try:
            effects = self.core.receive(message, asyncio.get_running_loop().time())
        except SessionAbort as exc:
            self.abort(exc)
            return
        self._apply(effects)

    def close_input(self) -> None:
        """The client closed its side: running actions finish, waiting ones cannot."""
        self.input_closed = True
        self._bump()
        self.outbox.put_nowait(None)

    def _apply(self, effects: Effects) -> None:
        self.send(effects.out)
        for action in effects.cancel:
            task = self.tasks.pop(action, None)
            if task is not None:
                task.cancel()
        for action in effects.start:
            self.tasks[action] = asyncio.create_task(self._run(action))
        if effects.changed:
            self._bump()
        self._schedule_ttl()

    async def _run(self, action: ActionState) -> None:
        try:
            await run_action(self, action)
        except InputClosed as exc:
            self.abort(SessionAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)))
        except SessionAbort as exc:
            self.abort(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must end this session, not the server
            log.exception("evergreen action %s failed", action.spec.label)
            self.abort(
                SessionAbort(grpc.StatusCode.INTERNAL, f"action {action.spec.label}: internal error: {exc}")
            )
        finally:
            if self.tasks.get(action) is asyncio.current_task():
                del self.tasks[action]
            self.outbox.put_nowait(None)

    # ------------------------------------------------------------------ TTLs
    def _schedule_ttl(self) -> None:
        deadline = self.core.next_deadline()
        if self._ttl_timer is not None:
            self._ttl_timer.cancel()
            self._ttl_timer = None
        if deadline is not None:
            self._ttl_timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._ttl_timer = None
        if self.failure is None:
            self._apply(self.core.expire(asyncio.get_running_loop().time()))

    # ------------------------------------------------------------------ ActionHost
    def send(self, fragments: list[pb.NodeFragment]) -> None:
        if fragments and self.failure is None:
            self.outbox.put_nowait(fragments)
            self._bump()  # outputs are inputs of later actions

    def _bump(self) -> None:
        self.version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_change(self, version: int, waiting_for: str = "") -> None:
        if self.version != version:
            return
        if self.input_closed:
            raise InputClosed(f"{waiting_for}: input never completed before the client closed its stream")
        await self._changed.wait()

    async def input(self, action: ActionState, name: str | None = None) -> Flattened:
        flat = self.core.input(action, name)
        for leaf in flat.leaves:
            for part in leaf.parts:
                if isinstance(part, Ref):
                    if is_text(leaf.mimetype) and part.uri not in self._texts:
                        text = await asyncio.to_thread(self._read_text, part.uri)
                        self._texts[part.uri], self._text_bytes[part.uri] = text, len(text.encode())
                    elif not is_text(leaf.mimetype) and part.uri not in self._sizes and leaf.complete:
                        self._sizes[part.uri] = (
                            await asyncio.to_thread(self.sandbox.summarize, part.uri)
                        ).size
        self._check_ref_expansion(flat)
        return flat

    def _check_ref_expansion(self, flat: Flattened) -> None:
        """flatten() bounded the inline bytes; a text ref is read once but its text goes into
        the prompt every time the leaf is used: the expanded text is bounded by max_bytes too."""
        limit = self.core.store.limits.max_bytes
        total = 0
        for leaf in flat.leaves:
            if is_text(leaf.mimetype):
                total += sum(self._text_bytes[p.uri] if isinstance(p, Ref) else len(p) for p in leaf.parts)
            if total > limit:
                raise exhausted(
                    f"node {leaf.id!r}: the input's text with its refs expanded passes the session "
                    f"byte limit max_bytes={limit} (--evergreen-max-bytes)"
                )

    def _read_text(self, uri: str) -> str:
        limit = self.core.store.limits.max_bytes
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces, size = [], 0
        try:
            for block in self.sandbox.open_blocks(uri):
                size += len(block)
                if size > limit:
                    raise exhausted(f"ref {uri!r}: larger than the session byte limit max_bytes={limit}")
                pieces.append(decoder.decode(block))
            pieces.append(decoder.decode(b"", final=True))
        except UnicodeDecodeError as exc:
            raise invalid(f"ref {uri!r}: text is not valid UTF-8 ({exc.reason})") from exc
        return "".join(pieces)

    def read_text(self, uri: str) -> str:
        return self._texts[uri]

    def measure(self, uri: str) -> int:
        if uri not in self._sizes:  # resolved by input() once the leaf is complete
            self._sizes[uri] = self.sandbox.summarize(uri).size
        return self._sizes[uri]

    # ------------------------------------------------------------------ ending
    def abort(self, error: SessionAbort) -> None:
        if self.failure is not None:
            return
        self.failure = error
        self.outbox.put_nowait(error)
        for task in self.tasks.values():
            task.cancel()

    @property
    def finished(self) -> bool:
        return self.input_closed and not self.tasks and self.outbox.empty()

    async def next_message(self) -> spb.SessionMessage | SessionAbort | None:
        """The next thing to send; fragments queued meanwhile go out in the same message."""
        item = await self.outbox.get()
        if not isinstance(item, list):
            return item
        fragments = item
        while len(fragments) < MAX_FRAGMENTS_PER_MESSAGE and not self.outbox.empty():
            more = self.outbox.get_nowait()
            if not isinstance(more, list):
                self.outbox.put_nowait(more)  # None or an abort: nothing is queued after an abort
                break
            fragments = fragments + more
        return spb.SessionMessage(node_fragments=fragments)

    async def close(self) -> None:
        if self._ttl_timer is not None:
            self._ttl_timer.cancel()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        self.pool.close()
