"""The runtime's state machine (sans-IO): sequences, controllers, and every op's reply.

`handle_main(msg, bias)` serves the synchronous main channel (ping, tokens,
post_pre_process, mid_process, stop) and writes mid_process biases into `bias`, a flat float32
view of the bin region. `handle_side(msg)` serves the side channel (mk_module, set_tags,
get_tags, instantiate) and is safe to call from other threads.

A sequence whose controller raises, times out or runs out of memory gets an error entry and
is dead from then on (never called again); everyone else's step goes on. Requests that are
wrong as a whole (bad JSON, unknown op, an id never assigned) get an error reply before any
state changes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwire.protocols.aici.bias_rows import BiasWriter
from tokenwire.protocols.aici.codec import (
    ProtocolError,
    error_reply,
    int_field,
    int_list,
    obj_list,
    ok_reply,
    seq_entry,
)
from tokenwire.protocols.aici.controller import (
    ControllerLimits,
    TokenizerEnv,
)
from tokenwire.protocols.aici.deadline import call_with_deadline, ticker
from tokenwire.protocols.aici.registry import ModuleRegistry
from tokenwire.protocols.aici.runtime_side import Instance, Sequence, SideChannel, describe
from tokenwire.protocols.aici.watchdog import CpuWatchdog, NoWatchdog

# CPU seconds a clone may take before the watchdog kills the runtime: a jsctrl clone replays
# the original's calls, each of which already ran within its own budget
CLONE_WATCHDOG_S = 5.0

log = logging.getLogger("tokenwire.aicirt")
_monotonic = time.monotonic

__all__ = ["AiciRuntime", "StopRuntime"]


class StopRuntime(Exception):
    """The engine sent `stop`: reply, then exit."""


@dataclass
class RuntimeStats:
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


class AiciRuntime(SideChannel):
    def __init__(
        self,
        env: TokenizerEnv,
        registry: ModuleRegistry,
        limits: ControllerLimits | None = None,
        *,
        tolerance_s: float = 0.005,
        max_rss_bytes: int | None = None,
        watchdog: CpuWatchdog | NoWatchdog | None = None,
    ) -> None:
        self.env = env
        self.registry = registry
        self.limits = limits or ControllerLimits()
        self.tolerance_s = tolerance_s  # scheduling slack on a shared CPU, added to every limit
        self.seqs: dict[int, Sequence] = {}
        self.instances: dict[str, Instance] = {}
        self._lock = threading.Lock()  # guards `instances` (side threads add, main takes)
        self.stats = RuntimeStats()
        # the whole runtime's memory (--max-runtime-mb): no new controller past it
        self.max_rss_bytes = max_rss_bytes
        self.watchdog = watchdog or NoWatchdog()
        self.freed_since_trim = 0  # controllers closed since the heap was last trimmed (aicirt)
        mask_vocab = env.ll_tokenizer.vocab_size if env.ll_tokenizer is not None else env.vocab_size
        self._writer = BiasWriter(env.vocab_size, mask_vocab)

    # ---- main channel ----------------------------------------------------------------------

    def handle_main(self, msg: dict[str, Any], bias: np.ndarray) -> dict[str, Any]:
        op = msg.get("op")
        try:
            if op == "ping":
                return ok_reply({"pong": 1})
            if op == "tokens":
                return ok_reply(
                    {
                        "vocab_size": self.env.vocab_size,
                        "eos_token_id": self.env.eos_token_id,
                        "max_forks": self.limits.max_forks,  # so the engine checks the same cap
                    }
                )
            if op == "post_pre_process":
                with ticker():
                    return ok_reply(self._post_pre(msg))
            if op == "mid_process":
                with ticker():
                    return ok_reply(self._mid(msg, bias))
            if op == "stop":
                raise StopRuntime
            raise ProtocolError(f"unknown op {op!r} on the main channel")
        except ProtocolError as e:
            return error_reply(f"{op}: {e}" if isinstance(op, str) else str(e))

    def _post_pre(self, msg: dict[str, Any]) -> dict[str, Any]:
        post_ops = obj_list(msg, "post_ops")
        pre_ops = obj_list(msg, "pre_ops")
        freed = int_list(msg, "freed", default=[])
        # validate everything first: a bad request changes nothing
        for sid in freed:
            if sid not in self.seqs:
                raise ProtocolError(f"freed sequence {sid} was never assigned")
        posts = []
        seqs = self.seqs
        freed_set = set(freed)
        for op in post_ops:
            sid = int_field(op, "id")
            backtrack = int_field(op, "backtrack", default=0)
            tokens = int_list(op, "tokens", default=[])
            if sid not in seqs or sid in freed_set:
                raise ProtocolError(f"post_ops: sequence {sid} was never assigned (or is freed)")
            posts.append((sid, backtrack, tokens))
        assigns = []
        with self._lock:
            for op in pre_ops:
                sid = int_field(op, "id")
                req_id = op.get("req_id")
                if not isinstance(req_id, str):
                    raise ProtocolError("pre_ops: 'req_id' must be a string")
                inst = self.instances.get(req_id)
                if inst is None or inst.assigned:
                    raise ProtocolError(f"pre_ops: no instantiated controller for req_id {req_id!r}")
                if sid in self.seqs and sid not in freed_set:
                    raise ProtocolError(f"pre_ops: sequence {sid} is already assigned")
                assigns.append((sid, req_id, inst))
            for _, _, inst in assigns:
                inst.assigned = True
            for _, req_id, _ in assigns:
                del self.instances[req_id]
        for sid in freed:
            gone = self.seqs.pop(sid)
            if gone.owns:
                self._close(gone.controller)
        post_seqs: dict[str, Any] = {}
        post_s = self.limits.post_s
        for sid, backtrack, tokens in posts:
            seq = seqs[sid]
            if seq.dead:
                continue
            seq.length = max(0, seq.length - backtrack) + len(tokens)
            entry, value = self._call(seq, "post_process", post_s, backtrack, tokens)
            if value is not None:
                stop = bool(value.stop)
                entry["result"] = {"stop": stop}
                seq.dead = stop
            post_seqs[str(sid)] = entry
        for sid, req_id, inst in assigns:
            self.seqs[sid] = Sequence(inst.controller, req_id, inst.self_timed, length=inst.length)
        pre_seqs: dict[str, Any] = {}
        pre_s = self.limits.pre_s
        for sid, seq in seqs.items():
            if seq.dead:
                continue
            entry, r = self._call(seq, "pre_process", pre_s)
            if r is not None:
                forks = int(r.num_forks)
                ff = r.ff_tokens
                # checked before anything is made for them, here and in the engine (a
                # set_num_forks(2**31 - 1) grew the server by 18 GB, one sequence per fork)
                error = self._over_caps("pre_process", forks, ff)
                if error:
                    self._fail(seq, entry, error)
                    pre_seqs[str(sid)] = entry
                    continue
                seq.num_forks, seq.clones_made = forks, 0
                seq.length += len(ff)
                entry["result"] = {
                    "suspend": bool(r.suspend),
                    "num_forks": forks,
                    "ff_tokens": [int(t) for t in ff] if ff else [],
                }
                if forks == 0:
                    seq.dead = True
            pre_seqs[str(sid)] = entry
        return {"post_seqs": post_seqs, "pre_seqs": pre_seqs}

    def _mid(self, msg: dict[str, Any], bias: np.ndarray) -> dict[str, Any]:
        ops = obj_list(msg, "ops")
        vocab = self.env.vocab_size
        if len(ops) * vocab > bias.size:
            raise ProtocolError(f"{len(ops)} sequences x {vocab} biases do not fit the bin region")
        plan: list[tuple[int, int | None]] = []
        new_ids: set[int] = set()
        for op in ops:
            sid = int_field(op, "id")
            clone_id = op.get("clone_id")
            if clone_id is None:
                if sid not in self.seqs:
                    raise ProtocolError(f"sequence {sid} was never assigned")
            else:
                clone_id = int_field(op, "clone_id")
                if clone_id not in self.seqs:
                    raise ProtocolError(f"clone_id {clone_id} was never assigned")
                if sid in self.seqs or sid in new_ids:
                    raise ProtocolError(f"clone target {sid} is already assigned")
                new_ids.add(sid)
            plan.append((sid, clone_id))
        seqs: dict[str, Any] = {}
        writer = self._writer
        writer.begin(len(plan))
        for row, (sid, clone_id) in enumerate(plan):
            if clone_id is not None:
                parent = self.seqs[clone_id]
                parent.clones_made += 1
                self.watchdog.arm(CLONE_WATCHDOG_S)
                try:
                    self._check_memory("clone")
                    child = parent.controller.clone(parent.clones_made)
                except Exception as e:  # a failed clone fails the new sequence only
                    child = parent.controller
                    self.seqs[sid] = Sequence(child, parent.req_id, parent.self_timed, dead=True, owns=False)
                    seqs[str(sid)] = seq_entry(None, error=f"clone failed: {describe(e)}")
                    continue
                finally:
                    self.watchdog.disarm()
                self.seqs[sid] = Sequence(child, parent.req_id, parent.self_timed, length=parent.length)
            seq = self.seqs[sid]
            if seq.dead:
                seqs[str(sid)] = seq_entry(None, error="sequence already stopped")
                continue
            entry, r = self._call(seq, "mid_process", self.limits.mid_s)
            if r is not None:
                error = self._over_caps("mid_process", 1, r.ff_tokens)
                if not error and not 0 <= r.backtrack <= seq.length:
                    error = (
                        f"mid_process: backtrack {r.backtrack} is more than the {seq.length} "
                        "tokens the sequence holds"
                    )
                if error:
                    self._fail(seq, entry, error)
                elif r.ff_tokens or r.backtrack:
                    entry["result"] = {
                        "ff_tokens": [int(t) for t in r.ff_tokens],
                        "backtrack": int(r.backtrack),
                    }
                else:
                    writer.add(row, r)
            seqs[str(sid)] = entry
        # every mask of the step at once (parallel llguidance), then all rows into the bin region
        for row, error in writer.finish(bias).items():
            sid, _ = plan[row]
            seq = self.seqs[sid]
            seq.dead = True
            self.stats.failures += 1
            entry = seqs[str(sid)]
            entry["error"] = f"mid_process: {error}"
            entry["logs"] += f"ERROR mid_process: {error}\n"
        return {"seqs": seqs, "num_seqs": len(plan)}

    def _call(self, seq: Sequence, what: str, limit_s: float, *args: Any) -> tuple[dict[str, Any], Any]:
        """Call `seq.controller.<what>(*args, deadline)` under its time limit: (the sequence's
        reply entry, the callback's value or None when it failed, which fails this sequence
        only). Runs once per sequence per op, so it is kept lean."""
        ctrl = seq.controller
        t0 = _monotonic()
        budget = limit_s + self.tolerance_s
        deadline = time.thread_time() + budget  # CPU time (deadline.py says why)
        self.stats.calls += 1
        error = ""
        value = None
        self.watchdog.arm(budget)
        try:
            value = call_with_deadline(
                getattr(ctrl, what),
                deadline,
                what,
                self_timed=seq.self_timed,
                args=(*args, deadline),
                remaining=budget,
            )
        except MemoryError:
            error = f"{what}: controller ran out of memory"
        except Exception as e:  # any controller failure fails its own sequence only
            error = f"{what}: {describe(e)}"
            if type(e).__name__ == "ControllerTimeout":
                self.stats.timeouts += 1
        finally:
            self.watchdog.disarm()
        t1 = _monotonic()
        if not error and value is None:
            error = f"{what}: the controller returned no result"
        logs, storage = ctrl.drain() if ctrl.logs or ctrl.storage else ("", [])
        if error:
            self.stats.failures += 1
            seq.dead = True
            logs += f"ERROR {error}\n"
            value = None
        entry = {
            "error": error,
            "result": None,
            "storage": storage,
            "logs": logs,
            "micros": int((t1 - t0) * 1e6),
        }
        return entry, value

    def _over_caps(self, what: str, forks: int, ff: list[int]) -> str:
        limits = self.limits
        if not 0 <= forks <= limits.max_forks:
            return f"{what}: {forks} forks asked for, the limit is {limits.max_forks} (--max-forks)"
        if len(ff) > limits.max_ff_tokens:
            return (
                f"{what}: {len(ff)} fast-forward tokens, the limit is {limits.max_ff_tokens} "
                "(--max-ff-tokens)"
            )
        return ""

    def _fail(self, seq: Sequence, entry: dict[str, Any], error: str) -> None:
        """Fail a sequence whose callback returned something over a cap."""
        self.stats.failures += 1
        seq.dead = True
        entry["result"] = None
        entry["error"] = error
        entry["logs"] += f"ERROR {error}\n"

    def close_all(self) -> None:
        for seq in self.seqs.values():
            if seq.owns:
                self._close(seq.controller)
        self.seqs.clear()
