"""ReplicaEngine: the EngineAPI (engine/api.py) over N engine replicas on Ray.

Every session call goes to the replica that holds the session (the session map: the named
directory actor, cached here because a session never moves); a new session, or a request without
one, goes where the Router says. Calls are blocking Ray round trips (~1 ms on one machine,
`tokenwire bench scale` measures it), as the in-process Engine's calls are blocking lock takes.

A replica that dies is marked down at once (by the first call or stream that sees it die): its
sessions' calls raise ReplicaLostError and their streams end unavailable; a monitor thread polls
every replica's stats (the router's load reports) and sees a restarted replica come back under
a new incarnation, when new sessions go to it again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tokenwire.engine.admission import check_request
from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import EngineError, InvalidRequestError, ReplicaLostError, SessionNotFoundError
from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.engine.request import FinishEvent, GenerateOptions
from tokenwire.engine.session import Ttl
from tokenwire.engine.vision import ImageBlock, ImageInput, SessionImage
from tokenwire.model.tokenizer import Tokenizer
from tokenwire.scale.aici import RemoteAici, RuntimeConfig
from tokenwire.scale.handle import RemoteHandle, _lost_errors
from tokenwire.scale.replica import GrammarRecipe, ReplicaInfo
from tokenwire.scale.router import Router, prefix_keys

if TYPE_CHECKING:
    from tokenwire.model.loader import ModelSource
    from tokenwire.scale.aici import RemoteAici

log = logging.getLogger("tokenwire.scale")
CACHE_ENTRIES = 100_000  # session -> replica lookups kept per ingress process
ENDED_EVERY_S = 5.0  # how often replicas are asked which sessions ended (expired) on their own


class ReplicaEngine(EngineAPI):
    def __init__(
        self,
        actors: list[Any],
        directory: Any,
        infos: list[ReplicaInfo],
        tokenizer: Tokenizer,
        *,
        prefix_aware: bool = True,
        detached: bool = False,
        poll_s: float = 0.25,
        call_timeout_s: float = 60.0,
        source: ModelSource | None = None,
    ) -> None:
        info = infos[0]
        self.replicas = actors
        self.directory = directory
        self.tokenizer = tokenizer
        self.name = info.name
        self.vocab_size = info.vocab_size
        self.logits_size = info.logits_size
        self.eos_ids = info.eos_ids
        self.max_model_len = info.max_model_len
        self.limits = info.limits
        self.config = info.config
        self.concepts = info.concepts
        self.kv_cache_mb = info.kv_cache_mb
        self.kv_block_size = info.kv_block_size
        self.device_type = info.device.partition(":")[0]  # "cuda:0" -> "cuda"
        self.source = source  # the model's files, here for the tokenizer (the weights are the replicas')
        # detached replicas (a joined cluster) keep their sessions when this ingress stops
        self.sessions_outlive_server = detached
        # (handle, FinishEvent) of every finished request: the metrics' per-replica series
        self.on_finish: Callable[[RemoteHandle, FinishEvent], None] | None = None
        self.incarnations = [i.incarnation for i in infos]
        self.up = [True] * len(actors)
        self.router = Router(len(actors), prefix_aware=prefix_aware)
        self._latest: list[dict[str, Any] | None] = [None] * len(actors)
        self._cache: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._lock = threading.RLock()
        self._timeout = call_timeout_s
        self._poll_s = poll_s
        self.ingress = uuid.uuid4().hex  # this process, to the replicas: where its events go
        self._handles: list[dict[str, RemoteHandle]] = [{} for _ in actors]
        self._streams: list[Any] = [None] * len(actors)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tokenwire-replicas", daemon=True)
        self._monitor.start()
        self._pumps = [
            threading.Thread(target=self._pump, args=(r,), name=f"tokenwire-events-{r}", daemon=True)
            for r in range(len(actors))
        ]
        for pump in self._pumps:
            pump.start()

    # ------------------------------------------------------------------ calls
    def _get(self, replica: int, ref: Any) -> Any:
        """ray.get with the replica's failures as engine errors (the engine's own message)."""
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray
        from ray.exceptions import GetTimeoutError, RayTaskError

        try:
            return ray.get(ref, timeout=self._timeout)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, EngineError | AttributeError):
                raise cause from None
            raise
        except _lost_errors() as exc:
            self.replica_lost(replica, exc)
            raise ReplicaLostError(
                f"engine replica {replica} was lost ({type(exc).__name__}); "
                "its sessions are gone, open a new one"
            ) from None
        except GetTimeoutError:
            raise ReplicaLostError(
                f"engine replica {replica} did not answer within {self._timeout:.0f}s"
            ) from None

    def _locate(self, session_id: str) -> tuple[int, str]:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        with self._lock:
            hit = self._cache.get(session_id)
        if hit is None:
            hit = ray.get(self.directory.lookup.remote(session_id), timeout=self._timeout)
            if hit is None:
                raise SessionNotFoundError(
                    f"session {session_id!r} not found (closed, expired or never opened)"
                )
            self._remember(session_id, hit)
        replica, incarnation = hit
        if not self.up[replica]:
            raise self._lost_session(session_id, replica)
        if incarnation != self.incarnations[replica]:
            # a replica restarted on its own --state-dir has its sessions back (engine/persistence.py)
            actor = self.replicas[replica]
            if not self._get(replica, actor.call.remote("has_session", session_id)):
                raise self._lost_session(session_id, replica)
            self._assign(session_id, replica)
            incarnation = self.incarnations[replica]
        return replica, incarnation

    def _lost_session(self, session_id: str, replica: int) -> ReplicaLostError:
        return ReplicaLostError(
            f"session {session_id} was on engine replica {replica}, which was lost (restarted); "
            "its KV is gone, open a new session"
        )

    def _session_call(self, session_id: str, call: Callable[[Any], Any]) -> Any:
        """call(actor) on the session's replica; a "not found" from a replica that restarted
        since the session was placed is reported as the replica's loss."""
        replica, incarnation = self._locate(session_id)
        try:
            return self._get(replica, call(self.replicas[replica]))
        except SessionNotFoundError:
            if self._get(replica, self.replicas[replica].ping.remote()) != incarnation:
                raise self._lost_session(session_id, replica) from None
            self._forget(session_id)
            raise

    def _remember(self, session_id: str, where: tuple[int, str]) -> None:
        with self._lock:
            self._cache[session_id] = where
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)

    def _forget(self, session_id: str) -> None:
        with self._lock:
            self._cache.pop(session_id, None)

    def _assign(self, session_id: str, replica: int) -> None:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        incarnation = self.incarnations[replica]
        ray.get(self.directory.assign.remote(session_id, replica, incarnation), timeout=self._timeout)
        self._remember(session_id, (replica, incarnation))
        with self._lock:
            self.router.opened(replica)

    def place(self, tokens: Sequence[int]) -> int:
        """The replica a new session or a session-less request on `tokens` goes to."""
        with self._lock:
            try:
                return self.router.place(prefix_keys(tokens)).replica
            except LookupError:
                raise ReplicaLostError("no engine replica is up (all are restarting)") from None

    # ------------------------------------------------------------------ sessions (Engine API)
    def create_session(self, tokens: Sequence[int] = (), ttl_s: float | Ttl | None = Ttl.DEFAULT) -> str:
        replica = self.place(tokens)
        sid = self._get(replica, self.replicas[replica].create_session.remote(list(tokens), ttl_s))
        self._assign(sid, replica)
        return sid

    def fork_session(self, session_id: str, at: int | None = None) -> str:
        child = self._session_call(session_id, lambda a: a.fork_session.remote(session_id, at))
        self._assign(child, self._locate(session_id)[0])
        return child

    def close_session(self, session_id: str) -> bool:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        try:
            closed = self._session_call(session_id, lambda a: a.close_session.remote(session_id))
        except (SessionNotFoundError, ReplicaLostError):
            closed = False
        with self._lock:
            replica = self._cache.get(session_id, (None,))[0]
        self._forget(session_id)
        ray.get(self.directory.remove.remote(session_id), timeout=self._timeout)
        if closed and replica is not None:
            with self._lock:
                self.router.opened(replica, -1)
        return closed

    def claim_session(
        self, session_id: str, protocol: str, owner: str = "", metadata: dict[str, Any] | None = None
    ) -> None:
        self._session_call(
            session_id, lambda a: a.call.remote("claim_session", session_id, protocol, owner, metadata)
        )

    def claimed_sessions(self, protocol: str | None = None) -> list[dict[str, Any]]:
        """Every replica's (those up), least recently used first: each replica restored its own
        from its state dir, and start_replicas put them in the session map."""
        found: list[dict[str, Any]] = []
        for replica, actor in enumerate(self.replicas):
            if self.up[replica]:
                found += self._get(replica, actor.call.remote("claimed_sessions", protocol))
        return sorted(found, key=lambda f: -f["idle_s"])

    def session_owner(self, session_id: str) -> str:
        return self._session_call(session_id, lambda a: a.call.remote("session_owner", session_id))

    def truncate_session(self, session_id: str, length: int) -> None:
        self._session_call(session_id, lambda a: a.call.remote("truncate_session", session_id, length))

    def session_tokens(self, session_id: str) -> list[int]:
        return self._session_call(session_id, lambda a: a.call.remote("session_tokens", session_id))

    def session_busy(self, session_id: str) -> bool:
        return self._session_call(session_id, lambda a: a.call.remote("session_busy", session_id))

    def touch_session(self, session_id: str) -> None:
        self._session_call(session_id, lambda a: a.call.remote("touch_session", session_id))

    def session_images(self, session_id: str) -> list[SessionImage]:
        return self._session_call(session_id, lambda a: a.call.remote("session_images", session_id))

    def image_block(self) -> ImageBlock | None:
        # Images are not taken under --replicas: the protocols never offered them here (the
        # image block was only built for an in-process engine), and that stays so until a test
        # covers images crossing to a replica.
        return None

    def image_tokens(self, data: bytes, mime: str | None = None) -> int:
        """An image's token count (the vision model's; every replica has the same)."""
        replica = self.place(())
        return self._get(replica, self.replicas[replica].call.remote("image_tokens", data, mime))

    def has_session(self, session_id: str) -> bool:
        try:
            return self._session_call(session_id, lambda a: a.call.remote("has_session", session_id))
        except (SessionNotFoundError, ReplicaLostError):
            return False

    def replica_of(self, session_id: str) -> int:
        """The replica index holding a session (tests, status)."""
        return self._locate(session_id)[0]

    # ------------------------------------------------------------------ generation
    def check(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        *,
        needs_room: bool = False,
    ) -> int:
        options = options or GenerateOptions()
        if session_id is None:  # no state to read: the admission check runs here
            check_request(self.limits, len(append), append, options, needs_room=needs_room)
            return len(append)
        return self._session_call(
            session_id,
            lambda a: a.call.remote("check", session_id, list(append), options, needs_room=needs_room),
        )

    def generate(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RemoteHandle:
        options = options or GenerateOptions()
        if options.constraint is not None:
            options = dataclasses.replace(options, constraint=self._portable(options.constraint))
        if session_id is None:
            replica, incarnation = self.place(append), ""
        else:
            replica, incarnation = self._locate(session_id)
        actor = self.replicas[replica]
        handle = RemoteHandle(replica, actor, uuid.uuid4().hex, self._ended)
        handle.load = float(len(append) + options.max_tokens)
        handle.origin = options.origin
        handle.ephemeral = session_id is None
        with self._lock:  # before the start: the pump may bring its first events before it returns
            self._handles[replica][handle.key] = handle
        try:
            started = actor.start.remote(
                self.ingress, handle.key, session_id, list(append), options, list(images)
            )
            try:
                sid, cached = self._get(replica, started)
            except SessionNotFoundError:
                if session_id is not None and self._get(replica, actor.ping.remote()) != incarnation:
                    raise self._lost_session(session_id, replica) from None
                raise
        except BaseException:
            with self._lock:
                self._handles[replica].pop(handle.key, None)
            raise
        handle.started(sid, cached)
        with self._lock:
            self.router.dispatched(replica, handle.load)
        return handle

    @staticmethod
    def _portable(constraint: Any) -> GrammarRecipe:
        """A constraint as the replica rebuilds it: grammars (JSON schema, regex, Lark) travel as
        their grammar text; other constraints (AICI controllers) cannot leave this process."""
        if not isinstance(constraint, GrammarConstraint):
            raise InvalidRequestError(
                f"{type(constraint).__name__} constraints are not available with --replicas (grammars are)"
            )
        return GrammarRecipe(constraint.grammar, constraint.vocab_size, constraint.eos_token_ids)

    def _ended(self, handle: RemoteHandle, event: FinishEvent, exc: BaseException | None) -> None:
        with self._lock:
            self._handles[handle.replica].pop(handle.key, None)
            self.router.finished(handle.replica, handle.load)
        if self.on_finish is not None:
            try:
                self.on_finish(handle, event)
            except Exception:  # observing must never break serving
                log.exception("on_finish observer failed")

    def _pump(self, replica: int) -> None:
        """One thread per replica: this process's `events` stream from it, each batch handed to
        the requests' handles. A dead replica fails every request it had; once Ray restarted
        it (the monitor sees it up again), a new stream opens."""
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        while not self._closed.is_set():
            if not self.up[replica]:
                self._closed.wait(0.05)
                continue
            stream = self.replicas[replica].events.options(num_returns="streaming").remote(self.ingress)
            self._streams[replica] = stream
            try:
                for ref in stream:
                    for key, (cached, events) in ray.get(ref).items():
                        with self._lock:
                            handle = self._handles[replica].get(key)
                        if handle is not None:
                            handle.deliver(cached, events)
            except _lost_errors() as exc:
                self.replica_lost(replica, exc)
                with self._lock:
                    lost = list(self._handles[replica].values())
                for handle in lost:
                    handle.fail(exc)
            except Exception as exc:
                if self._closed.is_set():
                    return
                log.warning("events of replica %d: %s; reopening", replica, exc)
                self._closed.wait(0.2)

    def model_call(self, name: str, *args: Any) -> Future[Any]:
        """On the least-loaded replica (see EngineAPI.model_call)."""
        replica = self.place(())
        return self.replicas[replica].model_call.remote(name, *args).future()

    def remote_aici(self, runtime_args: list[str], busy_wait_ms: float | None) -> RemoteAici:
        """`serve --aici` under --replicas: runs go whole to a replica, whose own runtime steers
        them (scale/aici.py)."""
        return RemoteAici(self, RuntimeConfig(runtime_args, busy_wait_ms))

    # ------------------------------------------------------------------ replica health and load
    def replica_lost(self, replica: int, exc: BaseException | None = None) -> None:
        with self._lock:
            if not self.up[replica]:
                return
            self.up[replica] = False
            self.router.set_up(replica, False)
        log.warning("engine replica %d lost (%s); its sessions end, Ray restarts it", replica,
                    type(exc).__name__ if exc else "unknown")  # fmt: skip

    def _watch(self) -> None:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        pending: dict[int, Any] = {}
        next_ended = time.monotonic() + ENDED_EVERY_S
        while not self._closed.wait(self._poll_s):
            for r, actor in enumerate(self.replicas):
                if r not in pending:
                    pending[r] = actor.stats.remote()
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=self._poll_s)
            ready_set = set(ready)
            for r, ref in list(pending.items()):
                if ref not in ready_set:
                    continue
                del pending[r]
                try:
                    stats = ray.get(ref)
                except _lost_errors() as exc:
                    self.replica_lost(r, exc)
                    continue
                except Exception:
                    log.exception("replica %d stats failed", r)
                    continue
                self._observe(r, stats)
            if time.monotonic() >= next_ended:
                next_ended = time.monotonic() + ENDED_EVERY_S
                self._drop_ended()

    def _observe(self, replica: int, stats: dict[str, Any]) -> None:
        with self._lock:
            self._latest[replica] = stats
            if stats["incarnation"] != self.incarnations[replica]:
                self.up[replica] = False  # restarted: the sessions placed before are gone
                self.router.set_up(replica, False)
                self.incarnations[replica] = stats["incarnation"]
                log.warning("engine replica %d restarted (%s): placing new sessions on it again", replica,
                            stats["incarnation"])  # fmt: skip
            elif not self.up[replica]:
                log.warning("engine replica %d is back", replica)
            self.up[replica] = True
            self.router.set_up(replica, True)
            self.router.report(
                replica, stats["load_tokens"], stats["kv_blocks_available"], stats["kv_blocks_total"],
                stats["sessions"],
            )  # fmt: skip

    def _drop_ended(self) -> None:
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        for r, actor in enumerate(self.replicas):
            if not self.up[r]:
                continue
            try:
                gone = ray.get(actor.ended.remote(), timeout=self._timeout)
                if gone:
                    ray.get(self.directory.forget.remote(gone), timeout=self._timeout)
                    for sid in gone:
                        self._forget(sid)
            except Exception as exc:  # a replica dying now is seen by the next stats poll
                log.debug("ended sessions of replica %d: %s", r, exc)

    def replica_stats(self) -> list[dict[str, Any] | None]:
        """Each replica's latest stats (None before its first report), with its state."""
        with self._lock:
            out = []
            for r, stats in enumerate(self._latest):
                out.append(None if stats is None else {**stats, "up": self.up[r]})
            return out

    def stats(self) -> dict[str, Any]:
        """The Engine.stats keys summed over the live replicas' latest reports (no round trip)."""
        total: dict[str, Any] = dict.fromkeys(_SUMMED, 0)
        total.update(kv_dtype="none", kv_bytes_per_token=0.0)  # every replica's, from the same flags
        for stats in self.replica_stats():
            if stats is not None and stats["up"]:
                for k in _SUMMED:
                    total[k] += stats.get(k, 0)
                total.update(
                    kv_dtype=stats.get("kv_dtype", "none"),
                    kv_bytes_per_token=stats.get("kv_bytes_per_token", 0.0),
                )
        return total

    @property
    def steps(self) -> int:
        return int(self.stats()["steps"])

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Stop watching and streaming (the replicas cancel this process's requests); the
        replicas end with the Ray driver that owns them (server.py shuts Ray down)."""
        # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
        import ray

        deadline = time.monotonic() + timeout_s
        self._closed.set()
        for stream in self._streams:
            if stream is not None:
                try:
                    ray.cancel(stream)
                except Exception:  # already ended
                    pass
        for thread in [self._monitor, *self._pumps]:
            thread.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        return True  # no model thread here: the replicas' own end with Ray


_SUMMED = (
    "sessions", "running", "waiting", "kv_blocks_total", "kv_blocks_available", "prefix_cache_blocks",
    "prefix_cache_hits", "steps", "computed_tokens", "kv_tokens_total",
    "spec_proposed", "spec_accepted", "spec_verifications",
)  # fmt: skip
