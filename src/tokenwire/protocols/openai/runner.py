"""Running a Plan on the engine from an asyncio loop: submit its choices, merge their events.

Engine events arrive on the model thread through RequestHandle.subscribe; they go into one
EventChannel per HTTP request, which wakes the loop once per batch, so everything one engine
step produced for a request's choices is handled together (for a stream: one write to the
socket).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import EngineError
from tokenwire.engine.events import EventChannel
from tokenwire.engine.request import Event, FinishEvent, RequestHandle
from tokenwire.protocols.openai.core import Plan
from tokenwire.protocols.openai.errors import OpenAIError, bad_request, from_engine

if TYPE_CHECKING:
    from starlette.requests import Request

    from tokenwire.engine.api import EngineAPI


class EventMux:
    """(choice index, event) batches from the model thread to one asyncio consumer."""

    def __init__(self, count: int) -> None:
        self._channel: EventChannel[tuple[int, Event]] = EventChannel()
        self.open = count  # choices not finished yet

    def sink(self, index: int) -> Callable[[Event], None]:
        return functools.partial(_tagged, self._channel, index)

    async def batches(self) -> AsyncIterator[list[tuple[int, Event]]]:
        while self.open:
            batch = await self._channel.get()
            self.open -= sum(isinstance(event, FinishEvent) for _, event in batch)
            yield batch


def _tagged(channel: EventChannel[tuple[int, Event]], index: int, event: Event) -> None:
    channel.push((index, event))  # model thread, engine lock held


class Execution:
    """A submitted plan: its handles, and the forks made for choices 2..n on a session."""

    def __init__(self, engine: EngineAPI, plan: Plan) -> None:
        self.engine = engine
        self.plan = plan
        self.handles: list[RequestHandle] = []
        self.forks: list[str] = []
        self.mux = EventMux(len(plan.choices))
        self.aborted = False  # the server is stopping: cancelled choices end in an error

    def submit(self) -> None:
        """Start every choice, or none: the session is checked (exists, idle, room) before a fork
        is made or anything appended; a failure after that cancels what started and closes the
        forks whatever it was, then is raised (an engine error as OpenAI's)."""
        plan, engine = self.plan, self.engine
        try:
            targets: list[str | None]
            if plan.session is not None:
                prompt, options = plan.choices[0]
                engine.check(plan.session, plan.prompts[prompt], options, needs_room=True)
                # forks first: they share the session's blocks as they are before the append
                self.forks = [engine.fork_session(plan.session) for _ in plan.choices[1:]]
                targets = [plan.session, *self.forks]
            else:
                targets = [None] * len(plan.choices)
            for index, ((prompt, options), target) in enumerate(zip(plan.choices, targets, strict=True)):
                handle = engine.generate(target, plan.prompts[prompt], options, images=plan.images)
                self.handles.append(handle)
                handle.subscribe(self.mux.sink(index))
        except EngineError as exc:
            self.close()
            raise from_engine(exc, "messages" if plan.kind == "chat" else "prompt") from exc
        except BaseException:
            self.close()
            raise

    async def batches(self) -> AsyncIterator[list[tuple[int, Event]]]:
        async for batch in self.mux.batches():
            for index, event in batch:
                if isinstance(event, FinishEvent):
                    out = self.plan.outputs[index]
                    out.cached_tokens = self.handles[index].cached_tokens
                    if event.reason == "error" and event.unavailable:  # its --replicas replica died
                        raise OpenAIError(
                            503,
                            event.error or "replica lost",
                            type="service_unavailable",
                            code="replica_lost",
                        )
                    if event.reason == "error" and event.bad_input:  # the request's grammar failed
                        message = f"the output constraint failed: {event.error}"
                        raise bad_request(message, code="invalid_grammar")
                    if event.reason == "error":
                        raise OpenAIError(
                            500, event.error or "generation failed", type="server_error", code="engine_error"
                        )
                    if event.reason == "cancelled" and (self.aborted or event.error):
                        # the server or the engine is shutting down (a client that left reads nothing)
                        raise OpenAIError(
                            503, "server shutting down", type="service_unavailable", code="shutting_down"
                        )
            yield batch

    def abort(self) -> None:
        """The server stops: end the request now, with a 503 error for the client."""
        self.aborted = True
        for handle in self.handles:
            handle.cancel()

    def close(self) -> None:
        """Cancel what still runs (a client that went away) and drop the forks."""
        for handle in self.handles:
            handle.cancel()
        for fork in self.forks:
            self.engine.close_session(fork)
        self.forks = []


async def watch_disconnect(request: Request, run: Execution) -> None:
    """A reply that is not streamed: its client going away stops its generation (every HTTP
    API's non-streaming route runs this beside its Execution)."""
    await on_disconnect(request, run.close)


async def on_disconnect(request: Request, stop: Callable[[], Any]) -> None:
    """Calls `stop` when the client goes away (the body is read: receive waits for that); a
    receive that fails once the reply is out ends the watch quietly."""
    with contextlib.suppress(Exception):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stop()
                return
