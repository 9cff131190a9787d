"""Engine side of the AICI channels: create them, spawn the runtime, talk to it.

Like an engine written to AICI's comms: creates the shared memory and semaphores, starts
`tokenwire-aicirt` (a process-group leader, killed as a group on close), checks it with ping and
tokens, then offers the synchronous main channel (`main`, one command at a time under a lock)
and the asynchronous side channel (`side`, any number in flight, matched by `$rid`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.protocols.aici.codec import decode_message, encode_message
from tokenwire.protocols.aici.shm import (
    MIB,
    MessageChannel,
    SharedRegion,
    channel_names,
    pid_prefix,
    sweep_stale_channels,
)

__all__ = ["AiciClient", "AiciError"]


class AiciError(RuntimeError):
    """The runtime answered with an error reply (or did not answer)."""


class AiciClient:
    def __init__(
        self,
        *,
        tokenizer: str = "default",
        json_mb: int = 32,
        bin_mb: int = 64,
        prefix: str | None = None,
        runtime_args: list[str] | None = None,
        runtime_cmd: list[str] | None = None,
        start_timeout_s: float = 120.0,
        busy_wait_ms: float = 0.0,
    ) -> None:
        sweep_stale_channels()  # left by engines killed outright (shm.py)
        self.prefix = prefix or pid_prefix()
        names = channel_names(self.prefix)
        self.cmd = MessageChannel(names["cmd"], json_mb * MIB, create=True)
        self.resp = MessageChannel(names["resp"], json_mb * MIB, create=True)
        self.side_cmd = MessageChannel(names["cmd_side"], json_mb * MIB, create=True)
        self.side_resp = MessageChannel(names["resp_side"], json_mb * MIB, create=True)
        self.bin = SharedRegion(names["bin"], bin_mb * MIB, create=True)
        exe = runtime_cmd or [str(Path(sys.executable).with_name("tokenwire-aicirt"))]
        args = [
            *exe,
            f"--tokenizer={tokenizer}",
            f"--json-size={json_mb}",
            f"--bin-size={bin_mb}",
            f"--name={self.prefix}",
            "--server",
            # the runtime spins this long for the next command (AICI's own default is 200 ms:
            # right beside an accelerator, wrong when the forward runs on the same CPU cores)
            f"--busy-wait-time={busy_wait_ms:g}",
            "--exit-with-parent",  # no orphan spinning on if this process is killed outright
            *(runtime_args or []),
        ]
        self.proc = subprocess.Popen(args)
        self._main_lock = threading.Lock()  # one main-channel command at a time
        self._main_op: Any = None
        # replies still owed to commands whose wait timed out: the runtime answers every command
        # in order, so the next reply(s) belong to those and would otherwise be taken as the
        # answer to the next command (a post_pre_process read as mid_process, and so on)
        self._unclaimed_replies = 0
        self._pending: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        # for the supervisor's hang check (stalled_s): when the oldest unanswered command was
        # sent, and when any reply last came
        self._main_sent_at: float | None = None
        self._side_sent_at: dict[str, float] = {}
        self._last_reply_at = time.monotonic()
        self._reader = threading.Thread(target=self._read_side, name="aici-side-reader", daemon=True)
        self._reader.start()
        try:
            self.main({"op": "ping"}, timeout=start_timeout_s)
            info = self.main({"op": "tokens"})
        except BaseException:
            self.close()
            raise
        self.vocab_size: int = int(info["vocab_size"])
        self.eos_token_id: int | None = info.get("eos_token_id")
        self.max_forks: int | None = info.get("max_forks")  # the runtime's --max-forks
        self._bias: np.ndarray = np.frombuffer(self.bin.map, dtype=np.float32, count=self.bin.size // 4)

    # ---- main channel ----------------------------------------------------------------------

    def main(self, msg: dict[str, Any], timeout: float | None = 60.0) -> dict[str, Any]:
        """Send one command and wait for its reply's data; AiciError on an error reply."""
        self.send_main(msg)
        return self.recv_main(timeout)

    def send_main(self, msg: dict[str, Any]) -> None:
        """The first half of `main`: send, and hold the channel until `recv_main` (so an engine
        can run its forward pass while the runtime works, as AICI's engines do for mid_process)."""
        self._main_lock.acquire()
        try:
            self.cmd.send(encode_message(msg))
        except BaseException:
            self._main_lock.release()
            raise
        self._main_op = msg.get("op")
        self._main_sent_at = time.monotonic()

    def recv_main(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """The second half of `main`: wait for the reply to the command `send_main` sent."""
        try:
            while True:
                payload = self.resp.recv(timeout=min(timeout or 1.0, 1.0))
                if payload is not None:
                    self._last_reply_at = time.monotonic()
                    if self._unclaimed_replies:
                        self._unclaimed_replies -= 1
                        continue
                    break
                if self.proc.poll() is not None:
                    raise AiciError(f"runtime exited with status {self.proc.returncode}")
                if timeout is not None:
                    timeout -= 1.0
                    if timeout <= 0:
                        self._unclaimed_replies += 1
                        raise AiciError(f"no reply to {self._main_op!r}")
        finally:
            self._main_sent_at = None
            self._main_lock.release()
        reply = decode_message(payload)
        if reply.get("type") != "ok":
            raise AiciError(str(reply.get("error") or reply))
        return reply.get("data") or {}

    def biases(self, n: int) -> np.ndarray:
        """The [n, vocab] rows of the last mid_process (a view: copy before the next one)."""
        return self._bias[: n * self.vocab_size].reshape(n, self.vocab_size)

    # ---- side channel ----------------------------------------------------------------------

    def side_future(self, op: str, **fields: Any) -> concurrent.futures.Future[dict[str, Any]]:
        rid = uuid.uuid4().hex
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._pending_lock:
            self._pending[rid] = fut
            self._side_sent_at[rid] = time.monotonic()
        msg = {"$rid": rid, "$auth": {"user": "localhost", "is_admin": True}, "op": op, **fields}
        with self._send_lock:
            self.side_cmd.send(encode_message(msg))
        return fut

    def side(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        return _unwrap(self.side_future(op, **fields).result(timeout))

    async def side_async(self, op: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """`timeout`: a runtime that stopped answering fails the call (AiciError), never hangs it."""
        fut = await asyncio.get_running_loop().run_in_executor(None, lambda: self.side_future(op, **fields))
        try:
            return _unwrap(await asyncio.wait_for(asyncio.wrap_future(fut), timeout))
        except TimeoutError:
            raise AiciError(f"the AICI runtime did not answer {op!r} within {timeout:g} s") from None

    def _read_side(self) -> None:
        while not self._closed:
            try:
                payload = self.side_resp.recv(timeout=0.5)
            except Exception:
                return
            if payload is None:
                continue
            try:
                reply = decode_message(payload)
            except ValueError:
                continue
            self._last_reply_at = time.monotonic()
            with self._pending_lock:
                fut = self._pending.pop(str(reply.get("$rid")), None)
                self._side_sent_at.pop(str(reply.get("$rid")), None)
            # a caller that stopped waiting (side_async's timeout, a cancelled run) cancelled its
            # future: set_result would raise InvalidStateError and end this thread, and every
            # later side call (instantiate, uploads) would wait for replies nobody reads
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_result(reply)

    # ---- lifecycle ---------------------------------------------------------------------------

    def fail_pending(self, message: str) -> None:
        """The runtime died: side-channel calls waiting for a reply fail now with `message`."""
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
            self._side_sent_at.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(AiciError(message))

    def stalled_s(self) -> float:
        """Seconds the runtime has owed a reply without sending any (0 when nothing is owed or
        replies keep coming): a runtime that is alive but stuck shows here, not in its exit."""
        with self._pending_lock:
            sent = [*self._side_sent_at.values()]
        if self._main_sent_at is not None:
            sent.append(self._main_sent_at)
        if not sent:
            return 0.0
        since = max(min(sent), self._last_reply_at)
        return max(0.0, time.monotonic() - since)

    def kill(self) -> None:
        """End a stuck runtime now (SIGKILL to its group); the supervisor then restarts it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._reader.join(timeout=2)
        with self._pending_lock:
            for fut in self._pending.values():
                fut.set_exception(AiciError("runtime closed"))
            self._pending.clear()
        for ch in (self.cmd, self.resp, self.side_cmd, self.side_resp):
            ch.close()
        del self._bias  # the numpy view pins the mapping
        self.bin.close()


def _unwrap(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("type") != "ok":
        raise AiciError(str(reply.get("error") or reply))
    return reply.get("data") or {}
