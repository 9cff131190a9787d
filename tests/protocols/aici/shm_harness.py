"""An engine-side AICI harness for the tests, written from the channel rules alone.

It does what an engine written to AICI's comms does: creates the shared memory objects and
semaphores (C-shm, C-wr = 1, C-rd = 0), spawns the runtime with aicirt's arguments as a
process-group leader, then speaks length-prefixed JSON frames. Deliberately independent of
tokenwire.protocols.aici (no shared code with the runtime or its client).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

MB = 2**20


class Chan:
    def __init__(self, name: str, size: int) -> None:
        self.names = (name + "-shm", name + "-wr", name + "-rd")
        for n in self.names[1:]:
            try:
                posix_ipc.unlink_semaphore(n)
            except posix_ipc.ExistentialError:
                pass
        shm = posix_ipc.SharedMemory(self.names[0], posix_ipc.O_CREAT, size=size)
        self.mem = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self.wr = posix_ipc.Semaphore(self.names[1], posix_ipc.O_CREAT, initial_value=1)
        self.rd = posix_ipc.Semaphore(self.names[2], posix_ipc.O_CREAT, initial_value=0)

    def send_raw(self, data: bytes) -> None:
        self.wr.acquire()
        self.mem[0:4] = struct.pack("<I", len(data))
        self.mem[4 : 4 + len(data)] = data
        self.rd.release()

    def recv_raw(self, timeout: float | None = 30.0) -> bytes:
        self.rd.acquire(timeout)
        (n,) = struct.unpack("<I", self.mem[0:4])
        data = bytes(self.mem[4 : 4 + n])
        self.wr.release()
        return data

    def unlink(self) -> None:
        self.mem.close()
        posix_ipc.unlink_shared_memory(self.names[0])
        for n in self.names[1:]:
            posix_ipc.unlink_semaphore(n)


class Harness:
    """One runtime process and its five shared objects."""

    def __init__(
        self, store_dir: Path, extra_args: list[str] | None = None, json_mb: int = 8, bin_mb: int = 32
    ):
        self.prefix = f"/twt{os.getpid() % 10000}{uuid.uuid4().hex[:4]}-"
        self.cmd = Chan(self.prefix + "cmd", json_mb * MB)
        self.resp = Chan(self.prefix + "resp", json_mb * MB)
        self.side_cmd = Chan(self.prefix + "cmd-side", json_mb * MB)
        self.side_resp = Chan(self.prefix + "resp-side", json_mb * MB)
        shm = posix_ipc.SharedMemory(self.prefix + "bin-shm", posix_ipc.O_CREAT, size=bin_mb * MB)
        self.bin = mmap.mmap(shm.fd, bin_mb * MB)
        shm.close_fd()
        exe = Path(sys.executable).with_name("tokenwire-aicirt")
        args = [
            str(exe),
            "--tokenizer=default",
            f"--json-size={json_mb}",
            f"--bin-size={bin_mb}",
            f"--name={self.prefix}",
            "--server",
            f"--store-dir={store_dir}",
            *(extra_args or []),
        ]
        self.proc = subprocess.Popen(args)
        self._pending: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read_side, daemon=True)
        self._reader.start()
        self.vocab_size = -1

    # main channel: one command, one reply
    def main(self, msg: dict[str, Any] | bytes) -> dict[str, Any]:
        self.cmd.send_raw(msg if isinstance(msg, bytes) else json.dumps(msg).encode())
        return json.loads(self.resp.recv_raw(timeout=60))

    def biases(self, n: int) -> np.ndarray:
        return (
            np.frombuffer(self.bin, dtype="<f4", count=n * self.vocab_size).reshape(n, self.vocab_size).copy()
        )

    # side channel: $rid-matched, replies in any order
    def side_send(self, msg: dict[str, Any] | bytes, rid: str | None = None) -> str:
        if isinstance(msg, dict):
            rid = rid or uuid.uuid4().hex
            msg = {"$rid": rid, "$auth": {"user": "tester", "is_admin": True}, **msg}
            msg = json.dumps(msg).encode()
        self.side_cmd.send_raw(msg)
        return rid or ""

    def side_wait(self, rid: str, timeout: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self._cond:
            while rid not in self._pending:
                if not self._cond.wait(timeout=max(0.0, end - time.monotonic())):
                    raise TimeoutError(f"no side reply for {rid}")
            return self._pending.pop(rid)

    def side(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.side_wait(self.side_send({"op": op, **fields}))

    def _read_side(self) -> None:
        while True:
            try:
                data = self.side_resp.recv_raw(timeout=None)
            except Exception:
                return
            reply = json.loads(data)
            with self._cond:
                self._pending[reply.get("$rid") or "<none>"] = reply
                self._cond.notify_all()

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the runtime made itself a group leader
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        for ch in (self.cmd, self.resp, self.side_cmd, self.side_resp):
            ch.unlink()
        self.bin.close()
        posix_ipc.unlink_shared_memory(self.prefix + "bin-shm")
