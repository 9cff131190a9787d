"""The engine: sessions, continuous batching and sampling around one model.

Public methods are thread-safe and cheap: they take the engine lock, change session state
and return. The model runs in one dedicated thread (`tokenwire-model`) that repeatedly picks
a step (scheduler.py), runs it without holding the lock, then samples and emits events.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.errors import (
    ContextOverflowError,
    EngineClosedError,
    InvalidTokenError,
    KVBudgetError,
    PositionError,
    SessionBusyError,
    SessionNotFoundError,
)
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import FinishEvent, GenerateOptions, Request, RequestHandle, covers
from tokenwire.engine.sampling_loop import after_step
from tokenwire.engine.scheduler import Scheduler
from tokenwire.engine.session import Session
from tokenwire.engine.step import run_step
from tokenwire.engine.stop import StopStringMatcher
from tokenwire.model.config import ModelConfig
from tokenwire.model.llama import LlamaModel
from tokenwire.model.tokenizer import Tokenizer

log = logging.getLogger("tokenwire.engine")
T = TypeVar("T")


class Engine:
    def __init__(
        self,
        model: LlamaModel | torch.nn.Module | Callable[[], torch.nn.Module],
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
    ) -> None:
        """`model` may be a factory: it then runs on the model thread (see _start)."""
        self.tokenizer = tokenizer
        self.name = name
        self.session_ttl_s = session_ttl_s
        self.concepts = concepts
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._sessions: dict[str, Session] = {}
        self._ids = itertools.count(1)
        self._model_calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._closed = False
        self.steps = 0
        self.computed_tokens = 0  # positions run through the model (prefill + decode), all steps
        self.source: Any = None  # the ModelSource when built by factory.build_engine
        ready: Future[None] = Future()
        setup = (model, kv_cache_mb, block_size, max_batch_tokens, max_running, max_model_len)
        self._thread = threading.Thread(
            target=self._run, args=(setup, ready), name="tokenwire-model", daemon=True
        )
        self._thread.start()
        ready.result()

    def _start(
        self,
        model: LlamaModel | torch.nn.Module | Callable[[], torch.nn.Module],
        kv_cache_mb: float,
        block_size: int,
        max_batch_tokens: int,
        max_running: int,
        max_model_len: int | None,
    ) -> None:
        """Runs on the model thread. Every large torch operation (loading, the KV allocation,
        each step) happens on this one thread: with a second thread also running OpenMP
        regions, libgomp sees more threads than cores, stops spinning between kernels and a
        decode step gets ~45% slower on a 2-core machine (measured)."""
        self.model = model if isinstance(model, torch.nn.Module) else model()
        self.config: ModelConfig = self.model.config
        self.vocab_size = max(self.tokenizer.vocab_size, 1)
        self.logits_size = self.config.vocab_size
        self.max_model_len = min(max_model_len or self.model.max_positions, self.model.max_positions)
        per_block = KVCache.bytes_per_block(self.config, block_size, self.model.dtype)
        num_blocks = max(2, int(kv_cache_mb * 2**20 // per_block))
        self.kv = KVCache(self.config, num_blocks, block_size, self.model.dtype, self.model.device)
        self.kv_cache_mb = num_blocks * per_block / 2**20
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_running, self._idle_sessions)

    def _run(self, setup: tuple[Any, ...], ready: Future[None]) -> None:
        torch.set_grad_enabled(False)
        # Denormal floats make CPU kernels orders of magnitude slower (seen with long runs of
        # near-zero activations); flushing them changes nothing measurable in the logits.
        torch.set_flush_denormal(True)
        try:
            self._start(*setup)
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._loop()

    # ------------------------------------------------------------------ sessions
    def create_session(self, tokens: Sequence[int] = (), ttl_s: float | None = -1.0) -> str:
        self._check_tokens(tokens)
        with self._lock:
            self._check_open()
            sid = uuid.uuid4().hex
            ttl = self.session_ttl_s if ttl_s == -1.0 else ttl_s
            self._sessions[sid] = Session(sid, tokens=list(tokens), ttl_s=ttl)
            return sid

    def close_session(self, session_id: str) -> bool:
        """Close a session, cancelling its request. Returns False if it did not exist."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return False
            if session.busy:
                assert session.request is not None
                self._finish(session.request, "cancelled")
            session.closed = True
            session.release(self.kv)
            return True

    def fork_session(self, session_id: str, at: int | None = None) -> str:
        with self._lock:
            src = self._session(session_id)
            at = len(src.tokens) if at is None else at
            if not 0 <= at <= len(src.tokens):
                raise PositionError(f"cannot fork at position {at}: session has {len(src.tokens)} tokens")
            child = src.fork(uuid.uuid4().hex, at, self.kv)
            self._sessions[child.id] = child
            return child.id

    def truncate_session(self, session_id: str, length: int) -> None:
        with self._lock:
            session = self._session(session_id)
            if session.busy:
                raise SessionBusyError(f"session {session_id} has a request running")
            if not 0 <= length <= len(session.tokens):
                raise PositionError(f"cannot truncate to {length}: session has {len(session.tokens)} tokens")
            session.truncate(length, self.kv)

    def session_tokens(self, session_id: str) -> list[int]:
        with self._lock:
            return list(self._session(session_id).tokens)

    def session_busy(self, session_id: str) -> bool:
        with self._lock:
            return self._session(session_id).busy

    def touch_session(self, session_id: str) -> None:
        with self._lock:
            self._session(session_id).touch()

    def has_session(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
    ) -> RequestHandle:
        """Append tokens to a session (a fresh one when None) and generate after them."""
        options = options or GenerateOptions()
        options.validate()
        self._check_tokens(append)
        self._check_tokens(options.stop_token_ids, what="stop_token_ids")
        self._check_tokens(options.sampling.logit_bias.keys(), what="logit_bias")
        if options.readout_ranges and self.concepts is None:
            raise PositionError("readouts requested but no concept file is loaded")
        with self._lock:
            self._check_open()
            if session_id is None:
                sid = uuid.uuid4().hex
                session = Session(sid, ephemeral=True)
                self._sessions[sid] = session
            else:
                session = self._session(session_id)
                if session.busy:
                    raise SessionBusyError(f"session {session_id} has a request running")
            new_len = len(session.tokens) + len(append)
            if new_len > self.max_model_len:
                if session.ephemeral:
                    self._sessions.pop(session.id, None)
                raise ContextOverflowError(
                    f"context overflow: {new_len} tokens exceed the model's context length "
                    f"{self.max_model_len}"
                )
            if new_len == 0:
                if session.ephemeral:
                    self._sessions.pop(session.id, None)
                raise InvalidTokenError("nothing to run: the session and the appended tokens are empty")
            blocks = -(-(new_len + 1) // self.kv.block_size)
            if blocks > self.kv.num_blocks:
                if session.ephemeral:
                    self._sessions.pop(session.id, None)
                raise KVBudgetError(
                    f"KV cache budget exhausted: {new_len} tokens need {blocks} blocks but the "
                    f"budget holds {self.kv.num_blocks} ({self.kv_cache_mb:.0f} MiB, --kv-cache-mb)"
                )
            session.tokens.extend(append)
            session.touch()
            request = Request(next(self._ids), session, options, new_len)
            self._prepare(request)
            session.request = request
            self.scheduler.add(request)
            self._wake.notify()
        return RequestHandle(request, self.cancel)

    def _prepare(self, request: Request) -> None:
        opts = request.options
        session = request.session
        prompt_len = request.prompt_len
        lp_ranges = opts.logprob_ranges or ()
        wanted = (
            sorted(p for p in range(prompt_len) if covers(lp_ranges, p) or covers(opts.readout_ranges, p))
            if (lp_ranges or opts.readout_ranges)
            else []
        )
        request.pending_prompt = wanted
        request.pending_set = set(wanted)
        # Positions whose logits/hidden states we need must be computed by this request.
        first = prompt_len - 1
        for p in wanted:
            first = min(first, p - 1 if covers(lp_ranges, p) and p > 0 else p)
        request.recompute_from = max(first, 0)
        session.uncompute_from(request.recompute_from, self.kv)
        if opts.sampling.seed is not None:
            request.generator = torch.Generator().manual_seed(opts.sampling.seed)
        else:
            request.generator = torch.Generator().manual_seed(
                int.from_bytes(uuid.uuid4().bytes[:8], "little")
            )
        request.decoder = self.tokenizer.incremental_decoder()
        if opts.stop:
            request.stopper = StopStringMatcher(list(opts.stop))
        if opts.constraint is not None:
            opts.constraint.start(list(session.tokens))

    def cancel(self, request: Request) -> None:
        with self._lock:
            if not request.finished:
                self._finish(request, "cancelled")

    def queue_position(self, handle: RequestHandle) -> int | None:
        """How many requests are admitted before this one (0 = next), or None once it runs or ended."""
        request = handle._request
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

    def _loop(self) -> None:
        last_reap = time.monotonic()
        while True:
            with self._lock:
                while not self._closed and not self._model_calls and not self.scheduler.has_work():
                    self._wake.wait(timeout=1.0)
                    if time.monotonic() - last_reap > 1.0:
                        self._reap_idle()
                        last_reap = time.monotonic()
                if self._closed:
                    return
                calls, self._model_calls = self._model_calls, []
                items = self.scheduler.schedule(self._finish)
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:
                        fut.set_exception(exc)
            if not items:
                continue
            capture = tuple(self.concepts.layers) if self.concepts is not None else ()
            try:
                output = run_step(self.model, self.kv, items, capture)
            except Exception as exc:  # a model failure fails this step's requests, not the engine
                log.exception("model step failed")
                with self._lock:
                    for item in items:
                        if not item.request.finished:
                            self._finish(item.request, "error", error=f"model step failed: {exc}")
                continue
            with self._lock:
                self.steps += 1
                self.computed_tokens += sum(item.count for item in items)
                after_step(self, items, output)
            if time.monotonic() - last_reap > 1.0:
                with self._lock:
                    self._reap_idle()
                last_reap = time.monotonic()

    def _finish(self, request: Request, reason: str, *, error: str | None = None, detail: Any = None) -> None:
        """Must hold the lock. Ends a request and emits its FinishEvent."""
        if request.finished:
            return
        request.finished = True
        self.scheduler.remove(request)
        session = request.session
        session.touch()
        # a request cut short may leave prompt positions that were never computed; that is fine:
        # the session keeps its tokens and the next request computes them.
        event = FinishEvent(reason, request.prompt_len, request.generated, error=error, stop_detail=detail)
        request.emit(event)
        if session.ephemeral:
            self._sessions.pop(session.id, None)
            session.closed = True
            session.release(self.kv)

    def _idle_sessions(self) -> list[Session]:
        """Sessions holding KV with no request running, least recently used first."""
        idle = [s for s in self._sessions.values() if not s.busy and s.block_table]
        return sorted(idle, key=lambda s: s.last_used)

    def _reap_idle(self) -> None:
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if session.ttl_s is not None and not session.busy and now - session.last_used > session.ttl_s:
                log.info("session %s expired after %.0fs idle", session.id, session.ttl_s)
                self.close_session(session.id)

    # ------------------------------------------------------------------ helpers
    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id!r} not found (closed, expired or never opened)")
        return session

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is shut down")

    def _check_tokens(self, tokens: Any, what: str = "token") -> None:
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidTokenError(f"{what} id {t!r} is outside the vocabulary [0, {self.vocab_size})")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            alloc = self.kv.allocator
            return {
                "sessions": len(self._sessions),
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_total": self.kv.num_blocks,
                "kv_blocks_available": alloc.num_available,
                "prefix_cache_blocks": alloc.num_cached,
                "prefix_cache_hits": alloc.hits,
                "steps": self.steps,
                "computed_tokens": self.computed_tokens,
            }

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(request, "cancelled", error="engine shutting down")
            self._closed = True
            for _, fut in self._model_calls:
                fut.cancel()
            self._wake.notify_all()
        self._thread.join(timeout=10)
