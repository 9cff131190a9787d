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

import json
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
    Controller,
    ControllerError,
    ControllerLimits,
    TokenizerEnv,
    VariableStore,
)
from tokenwire.protocols.aici.deadline import call_with_deadline, ticker
from tokenwire.protocols.aici.registry import ModuleRegistry, UnknownModule

log = logging.getLogger("tokenwire.aicirt")
_monotonic = time.monotonic

__all__ = ["AiciRuntime", "StopRuntime"]


class StopRuntime(Exception):
    """The engine sent `stop`: reply, then exit."""


@dataclass
class Sequence:
    controller: Controller
    req_id: str
    self_timed: bool
    dead: bool = False  # failed or stopped: never called again
    num_forks: int = 1  # from the last pre_process
    clones_made: int = 0


@dataclass
class Instance:
    controller: Controller
    self_timed: bool
    assigned: bool = False


@dataclass
class RuntimeStats:
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


class AiciRuntime:
    def __init__(
        self,
        env: TokenizerEnv,
        registry: ModuleRegistry,
        limits: ControllerLimits | None = None,
        *,
        tolerance_s: float = 0.005,
    ) -> None:
        self.env = env
        self.registry = registry
        self.limits = limits or ControllerLimits()
        self.tolerance_s = tolerance_s  # scheduling slack on a shared CPU, added to every limit
        self.seqs: dict[int, Sequence] = {}
        self.instances: dict[str, Instance] = {}
        self._lock = threading.Lock()  # guards `instances` (side threads add, main takes)
        self.stats = RuntimeStats()
        mask_vocab = env.ll_tokenizer.vocab_size if env.ll_tokenizer is not None else env.vocab_size
        self._writer = BiasWriter(env.vocab_size, mask_vocab)

    # ---- main channel ----------------------------------------------------------------------

    def handle_main(self, msg: dict[str, Any], bias: np.ndarray) -> dict[str, Any]:
        op = msg.get("op")
        try:
            if op == "ping":
                return ok_reply({"pong": 1})
            if op == "tokens":
                return ok_reply({"vocab_size": self.env.vocab_size, "eos_token_id": self.env.eos_token_id})
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
            del self.seqs[sid]
        post_seqs: dict[str, Any] = {}
        post_s = self.limits.post_s
        for sid, backtrack, tokens in posts:
            seq = seqs[sid]
            if seq.dead:
                continue
            entry, value = self._call(seq, "post_process", post_s, backtrack, tokens)
            if value is not None:
                stop = bool(value.stop)
                entry["result"] = {"stop": stop}
                seq.dead = stop
            post_seqs[str(sid)] = entry
        for sid, req_id, inst in assigns:
            self.seqs[sid] = Sequence(inst.controller, req_id, inst.self_timed)
        pre_seqs: dict[str, Any] = {}
        pre_s = self.limits.pre_s
        for sid, seq in seqs.items():
            if seq.dead:
                continue
            entry, r = self._call(seq, "pre_process", pre_s)
            if r is not None:
                forks = int(r.num_forks)
                seq.num_forks, seq.clones_made = forks, 0
                ff = r.ff_tokens
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
                try:
                    child = parent.controller.clone(parent.clones_made)
                except Exception as e:  # a failed clone fails the new sequence only
                    child = parent.controller
                    self.seqs[sid] = Sequence(child, parent.req_id, parent.self_timed, dead=True)
                    seqs[str(sid)] = seq_entry(None, error=f"clone failed: {_describe(e)}")
                    continue
                self.seqs[sid] = Sequence(child, parent.req_id, parent.self_timed)
            seq = self.seqs[sid]
            if seq.dead:
                seqs[str(sid)] = seq_entry(None, error="sequence already stopped")
                continue
            entry, r = self._call(seq, "mid_process", self.limits.mid_s)
            if r is not None:
                if r.ff_tokens or r.backtrack:
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
            error = f"{what}: {_describe(e)}"
            if type(e).__name__ == "ControllerTimeout":
                self.stats.timeouts += 1
        t1 = _monotonic()
        if not error and value is None:
            error = f"{what}: the controller returned no result"
        logs = _drain_logs(ctrl) if ctrl.logs else ""
        storage: list[Any] = []
        if ctrl.storage:
            storage, ctrl.storage = ctrl.storage, []
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

    # ---- side channel ----------------------------------------------------------------------

    def handle_side(self, msg: dict[str, Any]) -> dict[str, Any]:
        rid = msg.get("$rid")
        rid = rid if isinstance(rid, str) else None
        op = msg.get("op")
        try:
            if rid is None:
                raise ProtocolError("side-channel request without a string '$rid'")
            auth = msg.get("$auth") if isinstance(msg.get("$auth"), dict) else {}
            user = str(auth.get("user", "unknown"))
            if op == "mk_module":
                binary = msg.get("binary")
                if not isinstance(binary, str):
                    raise ProtocolError("mk_module needs 'binary' (base64 Wasm)")
                return ok_reply(self.registry.mk_module(binary), rid)
            if op == "set_tags":
                module_id, tags = msg.get("module_id"), msg.get("tags")
                if isinstance(tags, str):
                    tags = [tags]
                if not isinstance(module_id, str) or not isinstance(tags, list):
                    raise ProtocolError("set_tags needs 'module_id' (string) and 'tags' (list)")
                return ok_reply({"tags": self.registry.set_tags(module_id, tags, user)}, rid)
            if op == "get_tags":
                return ok_reply({"tags": self.registry.get_tags()}, rid)
            if op == "instantiate":
                return ok_reply(self._instantiate(msg), rid)
            raise ProtocolError(f"unknown op {op!r} on the side channel")
        except (ProtocolError, UnknownModule, ValueError) as e:
            return error_reply(f"{op}: {e}" if isinstance(op, str) else str(e), rid)

    def _instantiate(self, msg: dict[str, Any]) -> dict[str, Any]:
        req_id, module = msg.get("req_id"), msg.get("module_id")
        if not isinstance(req_id, str) or not req_id:
            raise ProtocolError("instantiate needs 'req_id' (non-empty string)")
        if not isinstance(module, str):
            raise ProtocolError("instantiate needs 'module_id' (module id or tag)")
        prompt = msg.get("prompt", [])
        if isinstance(prompt, str):
            prompt = self.env.tokenize(prompt)
        elif prompt is None:
            prompt = []
        elif not isinstance(prompt, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.env.vocab_size for t in prompt
        ):
            raise ProtocolError(f"'prompt' must be text or token ids in [0, {self.env.vocab_size})")
        arg = msg.get("module_arg", "")
        arg = "" if arg is None else arg if isinstance(arg, str) else json.dumps(arg)
        with self._lock:
            if req_id in self.instances or any(s.req_id == req_id for s in self.seqs.values()):
                raise ProtocolError(f"req_id {req_id!r} is already in use")
        _, factory, self_timed = self.registry.resolve(module)
        t0 = time.monotonic()
        deadline = time.thread_time() + self.limits.init_s + self.tolerance_s
        ctrl: Controller | None = None
        try:
            ctrl = call_with_deadline(
                lambda: factory(self.env, VariableStore(), self.limits, arg),
                deadline,
                "create",
                self_timed=self_timed,
            )
            c = ctrl
            tokens = call_with_deadline(
                lambda: c.init_prompt(list(prompt), deadline), deadline, "init_prompt", self_timed=self_timed
            )
        except MemoryError:
            return _failed_init(ctrl, "instantiate: controller ran out of memory", t0)
        except Exception as e:  # the controller's own failure: an ok reply carrying the error
            return _failed_init(ctrl, f"instantiate: {_describe(e)}", t0)
        with self._lock:
            self.instances[req_id] = Instance(ctrl, self_timed)
        storage, ctrl.storage = ctrl.storage, []
        tokens = [int(t) for t in tokens]
        return seq_entry(
            {"prompt": tokens, "ff_tokens": tokens},
            storage=storage,
            logs=_drain_logs(ctrl),
            micros=int((time.monotonic() - t0) * 1e6),
        )

    def drop_instance(self, req_id: str) -> None:
        with self._lock:
            self.instances.pop(req_id, None)


def _failed_init(ctrl: Controller | None, error: str, t0: float) -> dict[str, Any]:
    logs = (_drain_logs(ctrl) if ctrl is not None else "") + f"ERROR {error}\n"
    return seq_entry(None, error=error, logs=logs, micros=int((time.monotonic() - t0) * 1e6))


def _drain_logs(ctrl: Controller) -> str:
    lines, ctrl.logs = ctrl.logs, []
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _describe(e: BaseException) -> str:
    if isinstance(e, ControllerError) and type(e) is ControllerError:
        return str(e)
    return f"{type(e).__name__}: {e}"
