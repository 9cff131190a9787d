"""The engine: sessions, continuous batching and sampling around one model.

Public methods are thread-safe and cheap: they take the engine lock, change session state
and return. The model runs in one dedicated thread (`tokenwire-model`) whose loop is
[a draft model's guesses, without the lock (draft.py)] -> schedule (scheduler.py) -> run the
model (step.py, without the lock) -> postprocess
(postprocess.py: each request's events and finish) -> deliver (emit, end finished requests).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tokenwire.engine.admission import Limits, check_request, prepare
from tokenwire.engine.api import EngineAPI, model_function
from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.draft import DraftSpeculator, plan_drafts, run_drafts, settle_drafts
from tokenwire.engine.errors import (
    CapacityError,
    EngineClosedError,
)
from tokenwire.engine.lock_holds import LockHolds, now
from tokenwire.engine.model_setup import Loaded, load_model_and_cache
from tokenwire.engine.postprocess import Finish, Outcome, StepContext, postprocess
from tokenwire.engine.request import EngineHandle, FinishEvent, GenerateOptions, Request
from tokenwire.engine.scheduler import Scheduler
from tokenwire.engine.session import Session
from tokenwire.engine.session_calls import SessionCalls
from tokenwire.engine.speculation import SPECULATE, SpecStats, Speculator, StepCost, step_shape
from tokenwire.engine.step import StepItem, run_step
from tokenwire.engine.step_model import StepModel, check_step_model
from tokenwire.engine.step_team import StepTeam
from tokenwire.engine.vision import (
    EmbeddingCache,
    ImageBlock,
    ImageInput,
    decode_images,
    place_images,
    vision_tokens,
)
from tokenwire.model.config import ModelConfig
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # only types here: the loader is the factory's, persistence serve's
    from tokenwire.engine.persistence import SessionPersistence
    from tokenwire.model.loader import ModelSource

log = logging.getLogger("tokenwire.engine")
T = TypeVar("T")
REAP_INTERVAL_S = 1.0  # how often idle sessions are checked against their TTL


class Engine(SessionCalls, EngineAPI):
    # Sessions die with this process; a ReplicaEngine on detached replicas says True (scale/)
    sessions_outlive_server = False

    def __init__(
        self,
        model: DecoderModel | torch.nn.Module | Callable[[], torch.nn.Module],
        tokenizer: Tokenizer,
        *,
        name: str,
        kv_cache_mb: float = 512,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        max_running: int = 64,
        max_model_len: int | None = None,
        session_ttl_s: float | None = 1800.0,
        concepts: ConceptSet | None = None,
        max_sessions: int | None = None,
        max_queued: int | None = None,
        source: ModelSource | None = None,
        weights: str | None = None,
        kv_dtype: str = "auto",
        speculate: str = "ngram",
        draft: Engine | None = None,
        state: SessionPersistence | None = None,
    ) -> None:
        """`model` may be a factory: it then runs on the model thread (see _load). `source` and
        `weights`: where the model came from and the weight format it runs (factory.py), None
        for a model built in memory. `state`: where sessions persist (--state-dir), None: RAM only."""
        self.tokenizer = tokenizer
        self.name = name
        self.session_ttl_s = session_ttl_s
        # --max-sessions / --max-queued (docs/limits.md): None = no cap
        self.max_sessions = max_sessions
        self.max_queued = max_queued
        self.concepts = concepts
        self.source = source
        self.weights = weights
        if speculate not in SPECULATE:
            raise ValueError(f"unknown --speculate {speculate!r}: use one of {', '.join(SPECULATE)}")
        if (speculate == "draft") != (draft is not None):
            raise ValueError("--speculate draft and --draft-model come together")
        self.speculate = speculate
        self.draft = draft  # the draft model's engine (engine/draft.py)
        self.spec = SpecStats()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._sessions: dict[str, Session] = {}
        self._running: dict[str, Request] = {}  # session id -> its unfinished request
        # the sessions of the step running now (outside the lock) and those closed meanwhile:
        # their KV blocks are freed once the step is over, never under its feet (found by the
        # soak bench: a cancel mid-step freed blocks the step was indexing -> IndexError, and
        # blocks reallocated to another session while the step still wrote into them)
        self._stepping: set[str] = set()
        self._release_after_step: list[Session] = []
        self._ids = itertools.count(1)
        self._model_calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._closed = False
        # set first thing in shutdown(): long model-thread calls (GraphPipe's dense forward of a
        # whole batch) poll it between layers and give up, so the thread is free within a layer
        self.stopping = threading.Event()
        self._steps = 0
        # positions computed into a sequence's KV (prefill + decode), all steps: a rejected
        # guess's row (engine/speculation.py) runs but is not counted, it leaves nothing behind
        self.computed_tokens = 0
        # called (model thread, lock held) with each request as it finishes: metrics, access log
        self.on_finish: Callable[[Request, FinishEvent], None] | None = None
        self.lock_holds = LockHolds()  # the model thread's holds of the lock per step (bench spec)
        self.state = state
        self.write_behind = None  # started with the state (session_calls.py _open_state)
        loaded: Future[Loaded] = Future()
        assigned = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(
                (model, kv_cache_mb, block_size, max_model_len, kv_dtype, max_batch_tokens, max_running),
                loaded,
                assigned,
            ),
            name="tokenwire-model",
            daemon=True,
        )
        self._thread.start()
        built = loaded.result()
        try:
            self._assign(built, max_batch_tokens, max_running)
        except BaseException:
            self._closed = True  # the loop sees it first and returns
            raise
        finally:
            assigned.set()  # the loop reads the fields _assign sets

    def _assign(self, built: Loaded, max_batch_tokens: int, max_running: int) -> None:
        self.model = built.model
        # the same model as run_step sees it (engine/step_model.py), checked once here
        self.step_model: StepModel = check_step_model(built.model)
        self.config: ModelConfig = built.model.config
        self.kv = built.kv
        self.kv_block_size = self.kv.block_size
        self.device_type = self.model.device.type
        self.max_model_len = built.max_model_len
        self.kv_cache_mb = built.kv_cache_mb
        self.vocab_size = max(self.tokenizer.vocab_size, 1)
        self.logits_size = self.config.vocab_size
        # vision models: image embeddings by content hash (engine/vision.py)
        self.vision = EmbeddingCache() if vision_tokens(self.config) is not None else None
        # threads of the steps the fused decode kernel does not run (engine/step_team.py)
        self.step_team = StepTeam(self.model, enabled=self.kv.k.device.type == "cpu")
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        self.step_cost = StepCost()  # decode steps' time by rows: whether guesses pay (speculation.py)
        self.scheduler = Scheduler(
            self.kv, max_batch_tokens, max_running, self._idle_sessions, self.max_model_len, self.step_cost
        )
        self.limits = Limits(
            self.vocab_size, self.max_model_len, self.kv.num_blocks, self.kv.block_size,
            has_concepts=self.concepts is not None, kv_cache_mb=self.kv_cache_mb,
        )  # fmt: skip
        self._step_context = StepContext(
            self.kv, self.tokenizer, self.vocab_size, self.max_model_len, self.eos_ids, self.concepts
        )
        self._open_state()  # persisted sessions back (session_calls.py)

    def _run(self, setup: tuple[Any, ...], loaded: Future[Loaded], assigned: threading.Event) -> None:
        torch.set_grad_enabled(False)
        # Denormal floats make CPU kernels orders of magnitude slower (seen with long runs of
        # near-zero activations); flushing them changes nothing measurable in the logits.
        torch.set_flush_denormal(True)
        try:
            loaded.set_result(load_model_and_cache(*setup))
        except BaseException as exc:
            loaded.set_exception(exc)
            return
        assigned.wait()
        self._loop()

    def image_tokens(self, data: bytes, mime: str | None = None) -> int:
        """How many <|image_pad|> tokens this image takes in this model (its pad run's length);
        InvalidRequestError for a text-only model or bytes that are not a usable image."""
        (prepared,) = decode_images(self.model, [ImageInput(0, 0, data, mime)])
        return prepared.num_tokens

    def image_block(self) -> ImageBlock | None:
        ids = vision_tokens(self.config)
        return None if ids is None else ImageBlock(*ids, count=self.image_tokens)

    # ------------------------------------------------------------------ generation
    def check(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        *,
        needs_room: bool = False,
    ) -> int:
        """Raise the EngineError `generate` would raise for this request, without starting it
        (for protocols that answer before they change anything). Returns the prompt length.
        `needs_room`: see admission.check_request."""
        options = options or GenerateOptions()
        with self._lock:
            self._check_open()
            base = 0
            if session_id is not None:
                base = len(self._session(session_id).tokens)
                self._check_idle(session_id)
            prompt_len = base + len(append)
            check_request(self.limits, prompt_len, append, options, needs_room=needs_room)
            return prompt_len

    def generate(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        images: Sequence[ImageInput] = (),
    ) -> EngineHandle:
        """Append tokens to a session (a fresh one when None) and generate after them. `images`
        attaches images to blocks of the post-append tokens (vision models, engine/vision.py)."""
        options = options or GenerateOptions()
        prepared = decode_images(self.model, images) if images else []  # outside the lock: Pillow
        with self._lock:
            prompt_len = self.check(session_id, append, options)
            if self.max_queued is not None and len(self.scheduler.waiting) >= self.max_queued:
                raise CapacityError(
                    f"the server is saturated: {len(self.scheduler.waiting)} requests are queued "
                    f"(--max-queued {self.max_queued}); retry shortly"
                )
            existing = self._sessions[session_id] if session_id is not None else None
            added = []
            if images:
                tokens = [*(existing.tokens if existing else ()), *append]
                held = existing.images if existing else ()
                added = place_images(self.config, tokens, held, images, prepared)
            if session_id is None:
                session = Session(uuid.uuid4().hex, ephemeral=True)
                self._sessions[session.id] = session
            else:
                session = self._sessions[session_id]
            kept_length, kept_images = len(session.tokens), list(session.images)
            try:
                session.tokens.extend(append)
                if added:
                    session.images = sorted([*session.images, *added], key=lambda b: b.start)
                    session.uncompute_from(min(b.start for b in added), self.kv)  # pads as text
                session.touch()
                request = Request(next(self._ids), session, options, prompt_len)
                prepare(request, self.tokenizer, self.kv)
                if self._speculates(options):
                    request.speculator = Speculator() if self.draft is None else DraftSpeculator(self.draft)
                self.scheduler.add(request)
                self._running[session.id] = request
            except BaseException:
                # accepted but failed on the way in: nothing may stay of it (a one-off session
                # with no request never ends; a named one keeps its tokens as they were)
                if session_id is None:
                    del self._sessions[session.id]
                    self._release(session)
                else:
                    session.truncate(kept_length, self.kv)
                    session.images = kept_images
                raise
            self._wake.notify()
        return EngineHandle(request, self.cancel, self._queue_position)

    def _speculates(self, options: GenerateOptions) -> bool:
        """Prompt-lookup guesses (engine/speculation.py) need every step to run one arithmetic
        (the fused stack: a guess's row then gives a one-token step's bits; cut where readouts
        are captured, each layer's arithmetic is the same)."""
        return (
            self.speculate != "off"
            and options.speculate
            and options.max_tokens > 1
            and self.step_model.can_fuse_decode
        )

    def cancel(self, request: Request) -> None:
        with self._lock:
            self._finish(request, Finish("cancelled"))

    def _queue_position(self, request: Request) -> int | None:
        with self._lock:
            if request.finished or request not in self.scheduler.waiting:
                return None
            key = (request.options.priority, request.id)
            return sum(1 for r in self.scheduler.waiting if (r.options.priority, r.id) < key)

    # ------------------------------------------------------------------ model thread
    def call_on_model_thread(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the model thread between steps (for whole-tensor model calls)."""
        fut: Future[T] = Future()
        with self._lock:
            self._check_open()
            self._model_calls.append((fn, fut))
            self._wake.notify()
        return fut

    def model_call(self, name: str, *args: Any) -> Future[Any]:
        fn = model_function(name)
        return self.call_on_model_thread(lambda: fn(self, *args))

    def remote_aici(self, runtime_args: list[str], busy_wait_ms: float | None) -> None:
        return None  # `serve --aici` starts its runtime beside this engine (protocols/aici)

    @property
    def steps(self) -> int:
        return self._steps

    def holding(self) -> threading.RLock:
        """The engine lock, for a thread submitting many requests at once (engine/draft.py's
        guesses): the model thread schedules none of them before the last is in, so they run as
        one batch. Only this engine's public calls may be made while holding it."""
        return self._lock

    def _loop(self) -> None:
        next_reap = time.monotonic() + REAP_INTERVAL_S
        while True:
            with self._lock:
                taken = now()
                if self._closed:
                    return
                if time.monotonic() >= next_reap:
                    self._reap_idle()
                    next_reap = time.monotonic() + REAP_INTERVAL_S
                if not self._model_calls and not self.scheduler.has_work():
                    self._wake.wait(timeout=REAP_INTERVAL_S)
                    continue
                # the draft model's guesses (engine/draft.py): planned here, made without the
                # lock (API calls go on meanwhile), taken by the scheduler's propose()
                drafts = [] if self.draft is None else plan_drafts(self.scheduler)
                planning = now() - taken
            if self.draft is not None:
                run_drafts(self.draft, drafts)
            with self._lock:
                taken = now()
                settle_drafts(drafts)
                if self._closed:
                    return
                calls, self._model_calls = self._model_calls, []
                items = self._schedule()
                self._stepping = {item.request.session.id for item in items}
                scheduling = now() - taken
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:
                        fut.set_exception(exc)
            if not items:
                continue
            capture = tuple(self.concepts.layers) if self.concepts is not None else ()
            started = time.perf_counter()
            try:
                output = run_step(
                    self.step_model, self.kv, items, capture, vision=self.vision, team=self.step_team
                )
            except Exception as exc:  # a model failure fails this step's requests, not the engine
                log.exception("model step failed")
                with self._lock:
                    for item in items:
                        self._fail(item.request, f"model step failed: {exc}")
                    self._step_over()
                continue
            if all(item.count == 1 or item.draft for item in items):  # decode rows alone
                self.step_cost.observe(step_shape(items), time.perf_counter() - started)
            with self._lock:
                taken = now()
                self._steps += 1
                self.computed_tokens += sum(item.count for item in items)
                for outcome in postprocess(items, output, self._step_context):
                    self._deliver(outcome)
                self._step_over()
                self.lock_holds.add(scheduling, now() - taken, planning)

    def _schedule(self) -> list[StepItem]:
        """Must hold the lock. The next step's items; a scheduling bug fails the requests it
        could not place instead of ending the model thread (every request would hang)."""
        try:
            return self.scheduler.schedule(self._fail)
        except Exception as exc:
            log.exception("scheduling failed")
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self._fail(request, f"scheduling failed: {type(exc).__name__}: {exc}")
            return []

    def _deliver(self, outcome: Outcome) -> None:
        """Must hold the lock. Emit a request's events; end it if the step finished it."""
        request = outcome.request
        if outcome.guesses is not None:
            proposed, accepted = outcome.guesses
            self.spec.proposed += proposed
            self.spec.accepted += accepted
            self.spec.verifications += 1
            self.computed_tokens -= proposed - accepted
        if request.finished:
            return
        for event in outcome.events:
            request.emit(event)
        if outcome.finish is not None:
            self._finish(request, outcome.finish)

    def _fail(self, request: Request, error: str) -> None:
        self._finish(request, Finish("error", error=error))

    def _finish(self, request: Request, finish: Finish) -> None:
        """Must hold the lock. Ends a request and emits its FinishEvent (once)."""
        if request.finished:
            return
        request.finished = True
        self.scheduler.remove(request)
        if request.speculator is not None:
            request.speculator.close()
        session = request.session
        self._running.pop(session.id, None)
        session.touch()
        # a request cut short may leave prompt positions that were never computed; that is fine:
        # the session keeps its tokens and the next request computes them.
        event = FinishEvent(
            finish.reason,
            request.prompt_len,
            request.generated,
            finish.error,
            finish.detail,
            bad_input=finish.bad_input,
        )
        if self.on_finish is not None:  # first: a client that saw its end finds it counted
            try:
                self.on_finish(request, event)
            except Exception:  # observing must never break serving
                log.exception("on_finish observer failed")
        request.emit(event)
        if self.state is not None and not session.ephemeral:
            self.state.commit(session)  # the turn is in the session store (engine/persistence.py)
            if self.write_behind is not None and session.protocol:
                self.write_behind.poke()  # its KV to disk once idle (engine/kv_write_behind.py)
        if session.ephemeral:
            self._sessions.pop(session.id, None)
            self._release(session)

    # ------------------------------------------------------------------ helpers
    def stats(self) -> dict[str, Any]:
        with self._lock:
            alloc = self.kv.allocator
            return {
                "sessions": len(self._sessions),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_total": self.kv.num_blocks,
                "kv_dtype": self.kv.kv_dtype,
                "kv_tokens_total": self.kv.num_blocks * self.kv.block_size,
                "kv_bytes_per_token": self.kv.bytes_per_token,
                "kv_blocks_available": alloc.num_available,
                **self._window_stats(),
                "prefix_cache_blocks": alloc.num_cached,
                "prefix_cache_hits": alloc.hits,
                "steps": self._steps,
                "spec_proposed": self.spec.proposed,
                "spec_accepted": self.spec.accepted,
                "spec_verifications": self.spec.verifications,
                "computed_tokens": self.computed_tokens,
                **({"vision_tower_runs": self.vision.tower_runs} if self.vision is not None else {}),
                **(self.state.stats(self._sessions.values()) if self.state is not None else {}),
            }

    def _window_stats(self) -> dict[str, Any]:
        """The window pool's blocks (KVCache.window_pool): how many, how many sequences hold."""
        pool = self.kv.window_pool
        if pool is None:
            return {}
        held = pool.num_blocks - pool.allocator.num_available  # free and cached-unheld: available
        return {"kv_window": self.kv.window, "kv_window_blocks_total": pool.num_blocks,
                "kv_window_blocks_held": held, "kv_window_cache_hits": pool.allocator.hits}  # fmt: skip

    def check_stopping(self) -> None:
        """Raises EngineClosedError once shutdown() has begun: for long calls on the model thread."""
        if self.stopping.is_set():
            raise EngineClosedError("server shutting down")

    def shutdown(self, timeout_s: float = 10.0) -> bool:
        """Cancel everything and wait up to `timeout_s` for the model thread to leave its step
        (serve passes what is left of --shutdown-grace); whether it did."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(request, Finish("cancelled", error="engine shutting down"))
            self._closed = True
            for _, fut in self._model_calls:
                fut.cancel()
            self._wake.notify_all()
        self._thread.join(timeout=timeout_s)
        if self.write_behind is not None:  # after its chunk in flight: the flush writes the rest
            self.write_behind.stop(max(0.1, deadline - time.monotonic()))
        if self.state is not None:  # the KV still in RAM to disk, every row committed
            with self._lock:
                self.state.flush(list(self._sessions.values()), deadline, not self._thread.is_alive())
        if self.draft is not None:  # after ours: our last step may still be asking it for guesses
            self.draft.shutdown(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the model thread was still busy %.1f s after shutdown; exiting without it", timeout_s
            )
            return False
        return True
