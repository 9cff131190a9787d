"""Our engine drives the runtime: one Coordinator per runtime, one AiciConstraint per sequence.

The engine consults a sequence's Constraint at each of its sampling points (model thread, in
step order). AICI wants one post_pre_process + mid_process per step for all sequences (a
*round*): post_pre_process with every sequence's pending post op (its sampled token, or the
spliced tokens + backtrack), new assignments and freed ids, then mid_process for every live,
non-suspended sequence (plus the clones a fork asked for). Each sequence's result is cached
until its next sampling point takes it.

Overlap with the model forward. A round depends only on the tokens the sequences appended,
not on the next logits. So as soon as every live sequence has reported its token(s)
(`on_token`), and none still holds an unconsumed result, the round is submitted to a worker
thread; the runtime (another process) computes while the engine runs the next forward, and
`next_step` only waits for the reply. When that condition is not met (a sequence finished
without reporting, a new sequence joins, a sequence took pre ff_tokens and still holds its
mid result), the first sequence that needs a result runs the round itself, as without
overlap. Rounds never run concurrently, so the runtime sees the same sequence of commands.

A fork or suspend cannot be expressed through the Constraint hook, so the constraint ends its
request (stop) with `outcome` set; the run (run.py) forks the session / waits and resumes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenwire.engine.constraints import Constraint, ConstraintStep
from tokenwire.metrics import AICI_ROUND
from tokenwire.protocols.aici.client import AiciClient

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

__all__ = ["MAX_FORKS", "AiciConstraint", "Coordinator", "RoundStats", "SeqOutcome", "SeqState"]

# forks one pre_process may ask for when the runtime does not say (its --max-forks default). The
# runtime checks it too; this side checks before making a SeqState per fork whatever the runtime
# answers (num_forks 2**31 - 1 grew the server from 0.8 to 19 GB)
MAX_FORKS = 64


@dataclass
class SeqOutcome:
    # "stop" | "error" | "fork" | "suspend" | "wait" (retry once the others caught up) | "length"
    kind: str
    error: str = ""
    clone_ids: list[int] = field(default_factory=list)
    ff_tokens: list[int] = field(default_factory=list)  # pre ff to apply before forking


@dataclass
class SeqState:
    seq_id: int
    req_id: str | None  # set until assigned in a post_pre_process
    post_tokens: list[int] = field(default_factory=list)
    post_backtrack: int = 0
    has_post: bool = False
    owed: int = 0  # tokens the engine still has to report (on_token) for this step's post op
    pre: dict[str, Any] | None = None
    mid: dict[str, Any] | None = None  # {"bias" (tensor or None), "ff_tokens", "backtrack"}
    round_step: int | None = None  # engine step count when the round of `pre`/`mid` was submitted early
    clone_of: int | None = None  # mid op must carry clone_id (first round after a fork)
    entries: list[dict[str, Any]] = field(default_factory=list)  # runtime entries, for logs
    stopped: bool = False
    error: str = ""
    # its run is gone before the runtime assigned it: assigned (pre_op) in the next round only to
    # be freed in the one after, the one way AICI's protocol lets the runtime drop a controller
    discard: bool = False


@dataclass
class RoundStats:
    rounds: int = 0
    early_rounds: int = 0  # submitted from on_token, before the next forward
    round_s: float = 0.0  # wall time of all rounds (both round trips, the runtime's work included)
    wait_s: float = 0.0  # time sampling points spent waiting for rounds (or running them)
    # engine step -> seconds waited in it; only when a caller (the benchmark) sets it to {}
    wait_by_step: dict[int, float] | None = None
    overlapped: int = 0  # results taken after at least one engine step ran since their round started

    def json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "wait_by_step"}


class Coordinator:
    def __init__(
        self,
        client: AiciClient,
        vocab_size: int,
        *,
        overlap: bool = True,
        step_count: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self.vocab_size = vocab_size  # the engine's logits width used for sampling
        self.overlap = overlap
        self.step_count = step_count or (lambda: 0)  # the engine's step counter (for stats)
        self.max_forks = int(getattr(client, "max_forks", None) or MAX_FORKS)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self.seqs: dict[int, SeqState] = {}
        self._freed: list[int] = []
        self._inflight = False
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aici-round")
        self.stats = RoundStats()

    @classmethod
    def for_engine(cls, client: AiciClient, engine: EngineAPI) -> Coordinator:
        """The coordinator of `client`'s runtime for `engine` (its logits width, its step count)."""
        return cls(client, engine.vocab_size, step_count=lambda: engine.steps)

    @property
    def rounds(self) -> int:
        return self.stats.rounds

    def new_seq(self, req_id: str) -> SeqState:
        """A sequence for an instantiated controller. Its first round (assignment, pre_process,
        mid_process) may start at once and overlap the prompt's prefill."""
        with self._lock:
            state = SeqState(next(self._ids), req_id)
            self.seqs[state.seq_id] = state
            self.maybe_start_early()
            return state

    def free(self, seq_id: int) -> None:
        """The sequence's run is done with it (idempotent). It leaves the rounds at once: a
        sequence left here holding a result nobody takes would make `ready_for_round` false
        forever, and every other sequence would wait ("wait" outcomes) without end."""
        with self._lock:
            state = self.seqs.get(seq_id)
            if state is None:
                pass
            elif state.req_id is not None:  # the runtime holds its controller, not yet assigned
                state.stopped = state.discard = True
            else:  # the runtime knows it
                del self.seqs[seq_id]
                self._freed.append(seq_id)
            self.maybe_start_early()  # it may have been the one everybody waited for

    def drop_instance(self, req_id: str) -> None:
        """A controller instantiated for a run that is gone (refused, cancelled): the runtime
        drops it after the next rounds (see SeqState.discard). Any thread."""
        with self._lock:
            state = SeqState(next(self._ids), req_id, stopped=True, discard=True)
            self.seqs[state.seq_id] = state
            self.maybe_start_early()

    def drain_entries(self, seq_id: int) -> list[dict[str, Any]]:
        with self._lock:
            state = self.seqs.get(seq_id)
            if state is None:
                return []
            out, state.entries = state.entries, []
            return out

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # ---- rounds ----------------------------------------------------------------------------

    def maybe_start_early(self) -> None:
        """Lock held. Submit the next round now if every live sequence has reported (or is new)."""
        if not self.overlap or self._inflight or not self.ready_for_round():
            return
        # something to send: a post op, a new sequence, or a discarded one to assign or free
        if not any(
            (not s.stopped and (s.has_post or s.req_id is not None)) or s.discard for s in self.seqs.values()
        ):
            return
        msg = self._begin_round()
        self.stats.early_rounds += 1
        self._worker.submit(self._run_round, msg, self.step_count())

    def ready_for_round(self) -> bool:
        """Lock held. A round may run: no live sequence is still sampling (owes tokens) or holds
        a result it has not used (the runtime calls pre_process for every live sequence, so a
        round now would overwrite theirs)."""
        for s in self.seqs.values():
            if not s.stopped and (s.owed or s.pre is not None or s.mid is not None):
                return False
        return True

    def run_round_now(self) -> None:
        """Lock held, nothing in flight: one round, on the calling thread."""
        self._run_round(self._begin_round(), None)

    def wait_idle(self) -> None:
        """Lock held: wait until no round is in flight."""
        while self._inflight:
            self._cond.wait()

    def _begin_round(self) -> dict[str, Any]:
        pre_ops, post_ops = [], []
        for s in [s for s in self.seqs.values() if s.discard and s.req_id is None]:
            del self.seqs[s.seq_id]  # assigned in an earlier round: the runtime may free it now
            self._freed.append(s.seq_id)
        for s in self.seqs.values():
            if s.req_id is not None:
                pre_ops.append({"id": s.seq_id, "req_id": s.req_id})
            elif s.has_post and not s.stopped:
                post_ops.append({"id": s.seq_id, "tokens": s.post_tokens, "backtrack": s.post_backtrack})
            s.req_id = None
            s.post_tokens, s.post_backtrack, s.has_post, s.owed = [], 0, False, 0
            s.pre = s.mid = None
        freed, self._freed = self._freed, []
        self._inflight = True
        return {"op": "post_pre_process", "post_ops": post_ops, "pre_ops": pre_ops, "freed": freed}

    def _run_round(self, msg: dict[str, Any], early_step: int | None) -> None:
        t0 = time.perf_counter()
        involved = [op["id"] for op in msg["post_ops"] + msg["pre_ops"]]
        mid_ops: list[dict[str, Any]] = []
        try:
            data = self.client.main(msg)
            with self._lock:
                mid_ops = self._apply_post_pre(data, early_step)
                involved += [op["id"] for op in mid_ops]
            if mid_ops:
                data = self.client.main({"op": "mid_process", "ops": mid_ops})
                rows = self.client.biases(len(mid_ops))
                with self._lock:
                    self._apply_mid(mid_ops, data, rows)
        except Exception as e:  # the runtime failed or died: fail this round's sequences
            with self._lock:
                for op in mid_ops:  # clones of this round belong to no run yet: nobody frees them
                    if "clone_id" in op:
                        self.seqs.pop(op["id"], None)
                for sid in involved:
                    s = self.seqs.get(sid)
                    if s is not None:
                        s.stopped = True
                        s.error = s.error or f"AICI runtime: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self.stats.rounds += 1
                self.stats.round_s += time.perf_counter() - t0
                self._inflight = False
                self._cond.notify_all()
                if any(s.discard for s in self.seqs.values()):
                    self.maybe_start_early()  # discarded ones just assigned: free them

    def _apply_post_pre(self, data: dict[str, Any], early_step: int | None) -> list[dict[str, Any]]:
        for key, entry in data.get("post_seqs", {}).items():
            s = self.seqs.get(int(key))
            if s is not None:
                self._note(s, entry)
                if (entry.get("result") or {}).get("stop"):
                    s.stopped = True
        mid_ops: list[dict[str, Any]] = []
        for key, entry in data.get("pre_seqs", {}).items():
            s = self.seqs.get(int(key))
            if s is None:
                continue
            self._note(s, entry)
            s.pre = entry.get("result")
            s.round_step = early_step
            if s.stopped or s.pre is None:
                continue
            if s.pre.get("suspend") or s.pre.get("num_forks", 1) == 0:
                continue
            forks = s.pre.get("num_forks", 1)
            if not isinstance(forks, int) or not 1 <= forks <= self.max_forks:
                s.stopped = True  # before any SeqState is made for them
                s.error = s.error or (
                    f"the controller asked for {forks} forks, the limit is {self.max_forks} (--max-forks)"
                )
                continue
            mid_ops.append({"id": s.seq_id})
            for _ in range(forks - 1):  # forks: clones in the same mid
                child = SeqState(next(self._ids), None, clone_of=s.seq_id, round_step=early_step)
                self.seqs[child.seq_id] = child
                s.pre.setdefault("clone_ids", []).append(child.seq_id)
                mid_ops.append({"id": child.seq_id, "clone_id": s.seq_id})
        return mid_ops

    def _apply_mid(self, mid_ops: list[dict[str, Any]], data: dict[str, Any], rows: np.ndarray) -> None:
        # each row goes to sampling as it is, an additive bias (0 allowed, -inf not, or real
        # biases), copied here in the round (off the sampling path; the next round rewrites the
        # region): adding it is one vectorised pass, where a boolean mask fill took ~35x longer
        block = rows[:, : self.vocab_size]
        nonzero = (block != 0).any(axis=1)
        for i, op in enumerate(mid_ops):
            s = self.seqs.get(op["id"])
            entry = data.get("seqs", {}).get(str(op["id"]))
            if s is None or entry is None:
                continue  # freed meanwhile
            self._note(s, entry)
            result = entry.get("result") or {}
            s.mid = {
                "bias": torch.from_numpy(block[i].copy()) if nonzero[i] else None,
                "ff_tokens": list(result.get("ff_tokens") or []),
                "backtrack": int(result.get("backtrack") or 0),
            }

    def _note(self, s: SeqState, entry: dict[str, Any]) -> None:
        s.entries.append(entry)
        if entry.get("error"):
            s.stopped = True
            s.error = s.error or str(entry["error"])


class AiciConstraint(Constraint):
    """One sequence's view of the runtime, plugged into GenerateOptions.constraint."""

    def __init__(self, coord: Coordinator, state: SeqState) -> None:
        self.coord = coord
        self.state = state
        self.outcome: SeqOutcome | None = None
        self._splice: list[int] | None = None  # mid ff_tokens to force after the backtrack
        self._splice_backtrack = 0
        self._reporting: bool = True  # on_token appends to post op (False while forcing pre ff)
        self.sampled = 0
        self.forced = 0
        self.steps = 0  # tokens appended and backtracks, over the sequence's whole life
        self.step_limit: int | None = None  # run.steps_limit: then the sequence ends ("length")

    def next_step(self) -> ConstraintStep:
        with self.coord._lock:
            s = self.state
            if self.step_limit is not None and self.steps >= self.step_limit:
                self.outcome = SeqOutcome("length")
                return ConstraintStep(stop=True)
            if self._splice is not None:  # backtrack done: now append the spliced tokens
                ff, self._splice = self._splice, None
                s.post_backtrack = self._splice_backtrack
                s.has_post = True
                self._reporting = True
                self.forced += len(ff)
                return ConstraintStep(force=ff)
            if not self._await_results():
                # others are a step behind (forks that have not started yet): this sequence
                # cannot sample now; its request ends and run.py retries it shortly
                self.outcome = SeqOutcome("wait")
                return ConstraintStep(stop=True)
            if s.stopped:
                self.outcome = SeqOutcome("error" if s.error else "stop", s.error)
                return ConstraintStep(stop=True)
            if s.round_step is not None and (s.pre is not None or s.mid is not None):
                if self.coord.step_count() > s.round_step:
                    self.coord.stats.overlapped += 1  # a forward ran while the runtime worked
                s.round_step = None
            pre, s.pre = s.pre, None
            if pre is not None:
                clones = pre.get("clone_ids") or []
                if pre.get("suspend"):
                    self.outcome = SeqOutcome("suspend")
                    return ConstraintStep(stop=True)
                if clones:
                    self.outcome = SeqOutcome(
                        "fork", clone_ids=list(clones), ff_tokens=list(pre.get("ff_tokens") or [])
                    )
                    return ConstraintStep(stop=True)
                if pre.get("num_forks", 1) == 0:
                    self.outcome = SeqOutcome("stop")
                    return ConstraintStep(stop=True)
                ff = list(pre.get("ff_tokens") or [])
                if ff:  # already counted by the controller: not reported back; mid stays cached
                    self._reporting = False
                    self.forced += len(ff)
                    return ConstraintStep(force=ff)
            mid, s.mid = s.mid, None
            if mid is None:
                self.outcome = SeqOutcome("error", "runtime gave no mid_process result")
                return ConstraintStep(stop=True)
            self._reporting = True
            if mid["backtrack"] > 0:
                self._splice, self._splice_backtrack = mid["ff_tokens"], mid["backtrack"]
                s.owed = max(1, len(mid["ff_tokens"]))
                return ConstraintStep(backtrack=mid["backtrack"])
            if mid["ff_tokens"]:
                s.has_post = True
                s.owed = len(mid["ff_tokens"])
                self.forced += len(mid["ff_tokens"])
                return ConstraintStep(force=list(mid["ff_tokens"]))
            s.owed = 1
            self.sampled += 1
            return ConstraintStep(bias=mid["bias"])

    def speculation(self, guesses: list[int], limit: int) -> tuple[int, list[int]]:
        """The tokens a controller splices in after its backtrack are certain: they run as
        guesses after the token before them, in the same forward. Its other forced tokens come
        from the round that sees that token (mid_process), so nothing is known of them when the
        step is scheduled; the model's guesses run, and each row asks the controller as ever."""
        with self.coord._lock:
            if self._splice is not None:
                return 0, self._splice[:limit]
        return min(len(guesses), limit), []

    def on_token(self, token: int) -> None:
        with self.coord._lock:
            self.steps += 1
            if self._reporting:
                s = self.state
                s.post_tokens.append(token)
                s.has_post = True
                if s.owed > 0:
                    s.owed -= 1
                if s.owed == 0:  # this step's post op is complete: maybe everyone's is
                    self.coord.maybe_start_early()

    def _await_results(self) -> bool:
        """Lock held. Make sure this sequence has its step result: wait for the round in
        flight (started early, overlapping the forward), or run one now. False when it needs a
        round that cannot run yet (`ready_for_round`)."""
        coord, s = self.coord, self.state
        t0 = time.perf_counter()
        waited = coord._inflight
        coord.wait_idle()
        if not s.stopped and ((s.pre is None and s.mid is None) or s.has_post or s.req_id is not None):
            if not coord.ready_for_round():
                return False
            coord.run_round_now()
            waited = True
        if waited:
            waited_s = time.perf_counter() - t0
            AICI_ROUND.observe(waited_s)
            coord.stats.wait_s += waited_s
            by_step = coord.stats.wait_by_step
            if by_step is not None:
                step = coord.step_count()
                by_step[step] = by_step.get(step, 0.0) + waited_s
        return True

    def on_backtrack(self, n: int) -> None:
        with self.coord._lock:
            self.steps += 1
            self._splice_backtrack = n  # the engine may have capped it at what it generated
