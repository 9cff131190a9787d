"""One engine replica: an Engine (its own model copy and KV cache) inside a Ray actor process.

The actor is asynchronous (its methods run on one event loop), so a `cancel` arrives while
events stream. Engine calls take the engine lock for microseconds, as in-process. `start` starts
a request; its events are pushed by the engine's model thread into the outbox of the ingress
process that asked, and that process's one `events` stream yields the outbox once per wake-up:
every request of an engine step in one Ray object. (One streaming generator per request, the
first design, cost 32 objects per step at 32 streams: 0.72x the in-process tokens/s, measured.)

Code that must run on the model thread (GraphPipe's whole-tensor forward) is named, not pickled:
`model_call("tokenwire.module:function", ...)` runs that function of tokenwire's own code as
function(engine, ...) on this replica's model thread (EngineAPI.model_call).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenwire.engine.engine import Engine
from tokenwire.engine.events import EventChannel
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.engine.request import EngineHandle, Event, FinishEvent, GenerateOptions
from tokenwire.engine.session import Ttl
from tokenwire.heap import freeze_startup_heap
from tokenwire.scale.aici import ReplicaAici, RuntimeConfig

log = logging.getLogger("tokenwire.replica")
HISTORY = 10_000  # sessions whose served-request counts the replica remembers (for stats/tests)


@dataclass
class ReplicaInfo:
    """What the facade needs to stand in for the Engine's attributes (read once at start)."""

    index: int
    incarnation: str
    pid: int
    node: str
    name: str
    vocab_size: int
    logits_size: int
    eos_ids: frozenset[int]
    max_model_len: int
    limits: Any
    config: Any
    concepts: Any
    kv_block_size: int
    kv_cache_mb: float
    device: str
    steps: int = 0


@dataclass(frozen=True)
class GrammarRecipe:
    """A GrammarConstraint crossing to a replica: its llguidance grammar string, rebuilt there on
    the replica's own tokenizer (the matcher itself does not pickle)."""

    grammar: str
    vocab_size: int
    eos_token_ids: Any = None

    def build(self, tokenizer: Any) -> Any:
        return GrammarConstraint(tokenizer, self.vocab_size, self.grammar, eos_token_ids=self.eos_token_ids)


@dataclass
class _Active:
    handle: EngineHandle
    load: float  # tokens still to compute or generate (the router's load measure)
    ingress: str  # the front-end process whose `events` stream gets its events
    max_tokens: int
    started: float = field(default_factory=time.monotonic)


# One ingress process's outbox: (request key, event) from the engine's model thread to its
# `events` stream, one wake-up of the actor's loop per batch
Outbox = EventChannel[tuple[str, Event]]


class EngineReplica:
    """The actor class (cluster.py decorates it with the declared CPUs/GPUs and restarts)."""

    def __init__(self, index: int, settings: EngineSettings) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.index = index
        self.incarnation = uuid.uuid4().hex[:12]
        if settings.state_dir is not None:  # each replica its own state dir: a restart recovers it
            settings = replace(settings, state_dir=settings.state_dir / f"replica-{index}")
        self.engine: Engine = build_engine(settings)
        self._active: dict[str, _Active] = {}
        self._outboxes: dict[str, Outbox] = {}
        # sessions made here and not yet seen ended, from the persisted ones a restart restored
        # (engine/persistence.py: each replica its own state dir)
        self._known: set[str] = {found["id"] for found in self.engine.claimed_sessions()}
        self._served: OrderedDict[str, int] = OrderedDict()  # session -> generate requests served
        self._forks: OrderedDict[str, str] = OrderedDict()  # child -> parent
        self._aici = ReplicaAici(self.engine)  # its AICI runtime starts at the first AICI call
        freeze_startup_heap()  # heap.py says why
        log.info("replica %d (%s) ready in pid %d", index, self.incarnation, os.getpid())

    # ------------------------------------------------------------------ identity
    def info(self) -> ReplicaInfo:
        e = self.engine
        # local: ray is optional (the `ray` extra); this runs in the replica's actor
        import ray

        return ReplicaInfo(
            self.index, self.incarnation, os.getpid(), ray.util.get_node_ip_address(), e.name,
            e.vocab_size, e.logits_size, e.eos_ids, e.max_model_len, e.limits, e.config, e.concepts,
            e.kv.block_size, e.kv_cache_mb, str(e.model.device), e.steps,
        )  # fmt: skip

    def ping(self) -> str:
        return self.incarnation

    # ------------------------------------------------------------------ sessions (Engine API)
    def create_session(self, tokens: Sequence[int], ttl_s: float | Ttl | None = Ttl.DEFAULT) -> str:
        sid = self.engine.create_session(tokens, ttl_s)
        self._known.add(sid)
        return sid

    def fork_session(self, session_id: str, at: int | None) -> str:
        child = self.engine.fork_session(session_id, at)
        self._known.add(child)
        self._forks[child] = session_id
        if len(self._forks) > HISTORY:
            self._forks.popitem(last=False)
        return child

    def close_session(self, session_id: str) -> bool:
        self._known.discard(session_id)
        return self.engine.close_session(session_id)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The Engine's other quick session methods, by name (a fixed list: nothing else)."""
        fn = _PASSTHROUGH.get(method)
        if fn is None:
            raise AttributeError(f"replica has no engine method {method!r}")
        return fn(self.engine, *args, **kwargs)

    def sessions(self) -> tuple[str, list[str]]:
        """This incarnation and the sessions made here that are still open (a restarted session
        map rebuilds itself from these)."""
        return self.incarnation, [sid for sid in self._known if self.engine.has_session(sid)]

    def ended(self) -> list[str]:
        """Sessions made here that have since ended (expired, or closed by a request's end)."""
        gone = [sid for sid in self._known if not self.engine.has_session(sid)]
        self._known.difference_update(gone)
        return gone

    # ------------------------------------------------------------------ generation
    def _outbox(self, ingress: str) -> Outbox:
        box = self._outboxes.get(ingress)
        if box is None:
            box = self._outboxes[ingress] = Outbox()
        return box

    async def start(
        self,
        ingress: str,
        key: str,
        session_id: str | None,
        append: Sequence[int],
        options: GenerateOptions,
        images: Sequence[Any] = (),
    ) -> tuple[str, int]:
        """Start a request (an EngineError is raised instead when refused); its events go to
        the `events` stream of `ingress` (the front-end process that asked), under `key`.
        Returns the session id and the prompt positions whose KV was reused."""
        if isinstance(options.constraint, GrammarRecipe):
            options.constraint = options.constraint.build(self.engine.tokenizer.hf)
        handle = (
            self.engine.generate(session_id, append, options, images=images)
            if images
            else self.engine.generate(session_id, append, options)
        )
        sid = handle.session_id
        if session_id is not None:
            self._served[sid] = self._served.get(sid, 0) + 1
            self._served.move_to_end(sid)
            if len(self._served) > HISTORY:
                self._served.popitem(last=False)
        self._active[key] = _Active(
            handle, float(len(append) + options.max_tokens), ingress, options.max_tokens
        )
        handle.subscribe(functools.partial(_tagged, self._outbox(ingress), key))
        return sid, handle.cached_tokens

    async def events(self, ingress: str) -> AsyncIterator[dict[str, tuple[int, list[Event]]]]:
        """The events of every request `ingress` started, one dict {key: (cached tokens,
        events)} per wake-up: all requests of an engine step travel as one Ray object (32
        streams cost one object per step, not 32)."""
        box = self._outbox(ingress)
        try:
            while True:
                by_key: dict[str, list[Event]] = {}
                for key, event in await box.get():
                    by_key.setdefault(key, []).append(event)
                out: dict[str, tuple[int, list[Event]]] = {}
                for key, events in by_key.items():
                    active = self._active.get(key)
                    if active is None:  # cancelled by the stream's end: nobody waits for these
                        continue
                    active.load = max(0.0, active.max_tokens - active.handle.generated)
                    if isinstance(events[-1], FinishEvent):
                        del self._active[key]
                    out[key] = (active.handle.cached_tokens, events)
                if out:
                    yield out
        finally:  # the ingress process went away (or its stream was cancelled): stop its requests
            for key, active in list(self._active.items()):
                if active.ingress == ingress:
                    active.handle.cancel()
                    self._active.pop(key, None)
            self._outboxes.pop(ingress, None)

    def cancel(self, key: str) -> bool:
        active = self._active.get(key)
        if active is None:
            return False
        active.handle.cancel()
        return True

    async def model_call(self, name: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.engine.model_call(name, *args))

    # ------------------------------------------------------------------ AICI (scale/aici.py)
    async def aici_side(self, config: RuntimeConfig, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """An upload, a tag or the tag list, through this replica's AICI runtime."""
        return await self._aici.side(config, op, fields)

    async def aici_run(self, config: RuntimeConfig, req: Any) -> AsyncIterator[dict[str, Any]]:
        """One whole AICI run (`/v1/run`) on this replica's engine, its run objects streamed."""
        async for obj in self._aici.run(config, req):
            yield obj

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        """Engine stats plus what routing and `tokenwire ray status` need."""
        stats = self.engine.stats()
        stats.update(
            replica=self.index,
            incarnation=self.incarnation,
            pid=os.getpid(),
            load_tokens=sum(a.load for a in self._active.values()),
            streams=len(self._active),
        )
        return stats

    def served(self) -> dict[str, Any]:
        """Which sessions this replica ran requests for, and the forks it made (tests, status)."""
        return {"requests": dict(self._served), "forks": dict(self._forks)}

    def shutdown(self) -> None:
        self._aici.close()
        self.engine.shutdown()


def _tagged(box: Outbox, key: str, event: Event) -> None:
    """The engine's sink of one request (model thread, engine lock held)."""
    box.push((key, event))


_PASSTHROUGH: dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (
        Engine.truncate_session,
        Engine.session_tokens,
        Engine.session_busy,
        Engine.touch_session,
        Engine.has_session,
        Engine.check,
        Engine.session_images,
        Engine.image_tokens,
        Engine.claim_session,  # persisted sessions (issue 44): each replica its own state dir
        Engine.session_owner,
        Engine.claimed_sessions,  # how Responses and LMTP find theirs again after a restart
    )
}
