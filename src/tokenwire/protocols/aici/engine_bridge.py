"""Our engine drives the runtime: one Coordinator per runtime, one AiciConstraint per sequence.

The engine consults a sequence's Constraint at each of its sampling points (model thread, in
step order). AICI wants one post_pre_process + mid_process per step for all sequences, so the
first sequence that needs a step result starts a *round*: post_pre_process with every
sequence's pending post op (its sampled token, or the spliced tokens + backtrack), new
assignments and freed ids, then mid_process for every live, non-suspended sequence (plus the
clones a fork asked for). Each sequence's result is cached; the others of the same step take
theirs from the cache instead of starting another round.

A fork or suspend cannot be expressed through the Constraint hook, so the constraint ends its
request (stop) with `outcome` set; the run (run.py) forks the session / waits and resumes.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenwire.engine.constraints import Constraint, ConstraintStep
from tokenwire.protocols.aici.client import AiciClient

__all__ = ["AiciConstraint", "Coordinator", "SeqOutcome", "SeqState"]


@dataclass
class SeqOutcome:
    kind: str  # "stop" | "error" | "fork" | "suspend"
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
    pre: dict[str, Any] | None = None
    mid: dict[str, Any] | None = None  # {"bias": row copy | None, "ff_tokens", "backtrack"}
    clone_of: int | None = None  # mid op must carry clone_id (first round after a fork)
    entries: list[dict[str, Any]] = field(default_factory=list)  # runtime entries, for logs
    stopped: bool = False
    error: str = ""


class Coordinator:
    def __init__(self, client: AiciClient, vocab_size: int) -> None:
        self.client = client
        self.vocab_size = vocab_size  # the engine's logits width used for sampling
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.seqs: dict[int, SeqState] = {}
        self._freed: list[int] = []
        self.rounds = 0

    def new_seq(self, req_id: str) -> SeqState:
        with self._lock:
            state = SeqState(next(self._ids), req_id)
            self.seqs[state.seq_id] = state
            return state

    def free(self, seq_id: int) -> None:
        with self._lock:
            state = self.seqs.pop(seq_id, None)
            if state is not None and state.req_id is None:  # the runtime knows it
                self._freed.append(seq_id)

    def drain_entries(self, seq_id: int) -> list[dict[str, Any]]:
        with self._lock:
            state = self.seqs.get(seq_id)
            if state is None:
                return []
            out, state.entries = state.entries, []
            return out

    def run_round(self) -> None:
        """One AICI step for every sequence (called with the lock held by a constraint)."""
        pre_ops, post_ops = [], []
        for s in self.seqs.values():
            if s.req_id is not None:
                pre_ops.append({"id": s.seq_id, "req_id": s.req_id})
            elif s.has_post and not s.stopped:
                post_ops.append({"id": s.seq_id, "tokens": s.post_tokens, "backtrack": s.post_backtrack})
        freed, self._freed = self._freed, []
        data = self.client.main(
            {"op": "post_pre_process", "post_ops": post_ops, "pre_ops": pre_ops, "freed": freed}
        )
        self.rounds += 1
        for s in self.seqs.values():
            s.req_id = None
            s.post_tokens, s.post_backtrack, s.has_post = [], 0, False
            s.pre = s.mid = None
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
            if s.stopped or s.pre is None:
                continue
            if s.pre.get("suspend") or s.pre.get("num_forks", 1) == 0:
                continue
            mid_ops.append({"id": s.seq_id})
            for _ in range(int(s.pre.get("num_forks", 1)) - 1):  # forks: clones in the same mid
                child = SeqState(next(self._ids), None, clone_of=s.seq_id)
                self.seqs[child.seq_id] = child
                s.pre.setdefault("clone_ids", []).append(child.seq_id)
                mid_ops.append({"id": child.seq_id, "clone_id": s.seq_id})
        if not mid_ops:
            return
        data = self.client.main({"op": "mid_process", "ops": mid_ops})
        rows = self.client.biases(len(mid_ops))
        for i, op in enumerate(mid_ops):
            s = self.seqs[op["id"]]
            entry = data.get("seqs", {}).get(str(op["id"]))
            if entry is None:
                continue
            self._note(s, entry)
            result = entry.get("result") or {}
            s.mid = {
                "bias": rows[i, : self.vocab_size].copy(),
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

    def next_step(self) -> ConstraintStep:
        with self.coord._lock:
            s = self.state
            if self._splice is not None:  # backtrack done: now append the spliced tokens
                ff, self._splice = self._splice, None
                s.post_backtrack = self._splice_backtrack
                s.has_post = True
                self._reporting = True
                self.forced += len(ff)
                return ConstraintStep(force=ff)
            if (s.pre is None and s.mid is None) or s.has_post or s.req_id is not None:
                self.coord.run_round()
            if s.stopped:
                self.outcome = SeqOutcome("error" if s.error else "stop", s.error)
                return ConstraintStep(stop=True)
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
                return ConstraintStep(backtrack=mid["backtrack"])
            if mid["ff_tokens"]:
                s.has_post = True
                self.forced += len(mid["ff_tokens"])
                return ConstraintStep(force=list(mid["ff_tokens"]))
            bias = mid["bias"]
            finite = np.isfinite(bias)
            allowed = None if finite.all() else torch.from_numpy(finite)
            clean = torch.from_numpy(np.where(finite, bias, 0.0).astype(np.float32))
            self.sampled += 1
            return ConstraintStep(bias=clean if bias.any() else None, allowed=allowed)

    def on_token(self, token: int) -> None:
        with self.coord._lock:
            if self._reporting:
                self.state.post_tokens.append(token)
                self.state.has_post = True

    def on_backtrack(self, n: int) -> None:
        with self.coord._lock:
            self._splice_backtrack = n  # the engine may have capped it at what it generated

    def fork(self) -> AiciConstraint:
        raise NotImplementedError("AICI forks go through the runtime (num_forks), not Constraint.fork")
