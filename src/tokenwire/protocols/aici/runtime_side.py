"""The runtime's side channel (mk_module, set_tags, get_tags, instantiate), a part of AiciRuntime
(runtime.py) kept in its own file. Safe to call from the side-channel threads, except
`instantiate`, which aicirt runs on the main thread (runtime.py, aicirt.py say why)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenwire.protocols.aici.codec import ProtocolError, error_reply, ok_reply, seq_entry
from tokenwire.protocols.aici.controller import (
    Controller,
    ControllerError,
    ControllerLimits,
    TokenizerEnv,
    VariableStore,
)
from tokenwire.protocols.aici.deadline import call_with_deadline
from tokenwire.protocols.aici.registry import ModuleRegistry, UnknownModule

if TYPE_CHECKING:
    from tokenwire.protocols.aici.watchdog import CpuWatchdog, NoWatchdog

__all__ = ["Instance", "Sequence", "SideChannel", "describe", "rss_bytes"]

log = logging.getLogger("tokenwire.aicirt")


@dataclass
class Sequence:
    controller: Controller
    req_id: str
    self_timed: bool
    dead: bool = False  # failed or stopped: never called again
    num_forks: int = 1  # from the last pre_process
    clones_made: int = 0
    length: int = 0  # tokens the sequence holds (prompt included): the most it may backtrack
    owns: bool = True  # False for a clone that failed: it points at its parent's controller


@dataclass
class Instance:
    controller: Controller
    self_timed: bool
    assigned: bool = False
    length: int = 0


class SideChannel:
    """Side-channel ops of AiciRuntime (which sets these attributes)."""

    env: TokenizerEnv
    registry: ModuleRegistry
    limits: ControllerLimits
    tolerance_s: float
    seqs: dict[int, Sequence]
    instances: dict[str, Instance]
    max_rss_bytes: int | None
    watchdog: CpuWatchdog | NoWatchdog
    freed_since_trim: int
    _lock: threading.Lock

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
        budget = self.limits.init_s + self.tolerance_s
        deadline = time.thread_time() + budget
        ctrl: Controller | None = None
        variables = VariableStore(self.limits.max_var_bytes)
        self.watchdog.arm(budget)
        try:
            self._check_memory("instantiate")
            ctrl = call_with_deadline(
                lambda: factory(self.env, variables, self.limits, arg),
                deadline,
                "create",
                self_timed=self_timed,
            )
            c = ctrl
            tokens = call_with_deadline(
                lambda: c.init_prompt(list(prompt), deadline), deadline, "init_prompt", self_timed=self_timed
            )
        except MemoryError:
            return self._failed_init(ctrl, "instantiate: controller ran out of memory", t0)
        except Exception as e:  # the controller's own failure: an ok reply carrying the error
            return self._failed_init(ctrl, f"instantiate: {describe(e)}", t0)
        finally:
            self.watchdog.disarm()
        tokens = [int(t) for t in tokens]
        with self._lock:
            self.instances[req_id] = Instance(ctrl, self_timed, length=len(tokens))
        logs, storage = ctrl.drain()
        return seq_entry(
            {"prompt": tokens, "ff_tokens": tokens},
            storage=storage,
            logs=logs,
            micros=int((time.monotonic() - t0) * 1e6),
        )

    def _failed_init(self, ctrl: Controller | None, error: str, t0: float) -> dict[str, Any]:
        logs = ctrl.drain()[0] if ctrl is not None else ""
        self._close(ctrl)
        logs += f"ERROR {error}\n"
        return seq_entry(None, error=error, logs=logs, micros=int((time.monotonic() - t0) * 1e6))

    def drop_instance(self, req_id: str) -> None:
        with self._lock:
            inst = self.instances.pop(req_id, None)
        if inst is not None:
            self._close(inst.controller)

    def _check_memory(self, what: str) -> None:
        """Refuse new controllers while the runtime is over its memory cap (--max-runtime-mb)."""
        if self.max_rss_bytes is None:
            return
        rss = rss_bytes()
        if rss > self.max_rss_bytes:
            raise ControllerError(
                f"{what}: the AICI runtime holds {rss >> 20} MiB, over its limit of "
                f"{self.max_rss_bytes >> 20} MiB (--max-runtime-mb); retry later"
            )

    def _close(self, ctrl: Controller | None) -> None:
        if ctrl is not None:
            try:
                ctrl.close()
            except Exception:  # never fail a round over a controller's cleanup
                log.exception("closing a controller failed")
            self.freed_since_trim += 1


def rss_bytes() -> int:
    """This process's resident memory (/proc/self/statm: ~10 us)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def describe(e: BaseException) -> str:
    if isinstance(e, ControllerError) and type(e) is ControllerError:
        return str(e)
    return f"{type(e).__name__}: {e}"
