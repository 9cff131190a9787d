"""One engine replica: an Engine (its own model copy and KV cache) inside a Ray actor process.

The actor is asynchronous (its methods run on one event loop), so a `cancel` arrives while
`generate` streams. Engine calls take the engine lock for microseconds, as in-process. Token
events are pushed by the engine's model thread into a per-request batch; the `generate` stream
yields one batch per wake-up (all events of an engine step together: one Ray object per step and
stream, not one per token).

Code that must run on the model thread (GraphPipe's whole-tensor forward) is named, not pickled:
`model_call(name, ...)` runs a function registered in `MODEL_CALLS` with this replica's engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import Event, FinishEvent, GenerateOptions, RequestHandle, TokenEvent
from tokenwire.engine.session import Ttl

log = logging.getLogger("tokenwire.replica")
REPLICA_PREFIX = "tokenwire-replica-"
HISTORY = 10_000  # sessions whose served-request counts the replica remembers (for stats/tests)

# name -> fn(engine, *args), run on the replica's model thread by model_call
MODEL_CALLS: dict[str, Callable[..., Any]] = {}


def model_call(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a model-thread function under `name` (module import time, on every process)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        MODEL_CALLS[name] = fn
        return fn

    return register


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


@dataclass
class _Active:
    handle: RequestHandle
    load: float  # tokens still to compute or generate (the router's load measure)
    started: float = field(default_factory=time.monotonic)


class EngineReplica:
    """The actor class (cluster.py decorates it with the declared CPUs/GPUs and restarts)."""

    def __init__(self, index: int, settings: EngineSettings) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.index = index
        self.incarnation = uuid.uuid4().hex[:12]
        self.engine: Engine = build_engine(settings)
        self._active: dict[str, _Active] = {}
        self._known: set[str] = set()  # sessions made here and not yet seen ended
        self._served: OrderedDict[str, int] = OrderedDict()  # session -> generate requests served
        self._forks: OrderedDict[str, str] = OrderedDict()  # child -> parent
        log.info("replica %d (%s) ready in pid %d", index, self.incarnation, os.getpid())

    # ------------------------------------------------------------------ identity
    def info(self) -> ReplicaInfo:
        e = self.engine
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
        if method not in _PASSTHROUGH:
            raise AttributeError(f"replica has no engine method {method!r}")
        return getattr(self.engine, method)(*args, **kwargs)

    def ended(self) -> list[str]:
        """Sessions made here that have since ended (expired, or closed by a request's end)."""
        gone = [sid for sid in self._known if not self.engine.has_session(sid)]
        self._known.difference_update(gone)
        return gone

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        key: str,
        session_id: str | None,
        append: Sequence[int],
        options: GenerateOptions,
        images: Sequence[Any] = (),
    ) -> AsyncIterator[tuple[str, int, list[Event]]]:
        """Stream (session id, cached tokens, events) batches; the first has no events and comes
        as soon as the engine took the request (an EngineError is raised instead)."""
        handle = (
            self.engine.generate(session_id, append, options, images=images)
            if images
            else (self.engine.generate(session_id, append, options))
        )
        sid = handle.session_id
        if session_id is not None:
            self._served[sid] = self._served.get(sid, 0) + 1
            self._served.move_to_end(sid)
            if len(self._served) > HISTORY:
                self._served.popitem(last=False)
        active = self._active[key] = _Active(handle, float(len(append) + options.max_tokens))
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        lock = threading.Lock()
        pending: list[Event] = []

        def sink(event: Event) -> None:  # model thread, engine lock held: be quick
            with lock:
                pending.append(event)
                first = len(pending) == 1
            if first:
                loop.call_soon_threadsafe(wake.set)

        done = False
        try:
            yield sid, handle.cached_tokens, []
            handle.subscribe(sink)
            while not done:
                await wake.wait()
                wake.clear()
                with lock:
                    batch = pending[:]
                    pending.clear()
                if not batch:
                    continue
                for event in batch:
                    if isinstance(event, TokenEvent) and not event.is_prefill:
                        active.load = max(0.0, options.max_tokens - handle._request.generated)
                done = isinstance(batch[-1], FinishEvent)
                yield sid, handle.cached_tokens, batch
        finally:
            if not done:
                handle.cancel()  # the consumer went away or the task was cancelled
            self._active.pop(key, None)

    def cancel(self, key: str) -> bool:
        active = self._active.get(key)
        if active is None:
            return False
        active.handle.cancel()
        return True

    async def model_call(self, name: str, *args: Any) -> Any:
        fn = MODEL_CALLS.get(name)
        if fn is None:
            raise AttributeError(f"no model call named {name!r} on the replica")
        engine = self.engine
        return await asyncio.wrap_future(engine.call_on_model_thread(lambda: fn(engine, *args)))

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
        self.engine.shutdown()


_PASSTHROUGH = frozenset(
    {
        "truncate_session",
        "session_tokens",
        "session_busy",
        "touch_session",
        "has_session",
        "check",
        "session_images",
        "image_tokens",
    }
)
