"""POSIX shared memory + named semaphores: AICI's message channels and the bias region.

A message channel C is the shared memory object ``C-shm`` plus two semaphores: ``C-wr``
(1 = the writer may write) and ``C-rd`` (1 = a message is ready). One message at a time lives
at offset 0 as a frame (codec.py). The engine creates every object; the runtime only opens
them (``create=False``), so whoever starts first decides the sizes.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from pathlib import Path

import posix_ipc

from tokenwire.protocols.aici.codec import FRAME_HEADER, FrameError, frame_length, write_frame

MIB = 2**20
_VALUE_READABLE = bool(posix_ipc.SEMAPHORE_VALUE_SUPPORTED)  # not on macOS
DEFAULT_PREFIX = "/aici0-"

__all__ = ["DEFAULT_PREFIX", "MIB", "ChannelClosed", "MessageChannel", "SharedRegion", "channel_names"]


class ChannelClosed(RuntimeError):
    """The channel was closed while waiting on it."""


def channel_names(prefix: str) -> dict[str, str]:
    """The five AICI objects of one runtime, by role."""
    return {
        "cmd": prefix + "cmd",
        "resp": prefix + "resp",
        "cmd_side": prefix + "cmd-side",
        "resp_side": prefix + "resp-side",
        "bin": prefix + "bin",
    }


class SharedRegion:
    """A POSIX shared memory object mapped read-write (``NAME-shm``)."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name + "-shm"
        self.created = create
        if create:
            _unlink_shm(self.name)  # a stale object of a crashed run would keep its old size
            shm = posix_ipc.SharedMemory(self.name, flags=posix_ipc.O_CREX, size=size)
        else:
            try:
                shm = posix_ipc.SharedMemory(self.name)
            except posix_ipc.ExistentialError as e:
                raise FileNotFoundError(
                    f"shared memory {self.name} does not exist (engine not started?)"
                ) from e
            size = shm.size
        try:
            self.map = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.size = size

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a numpy view is still alive: the mapping goes when it does
            pass
        if self.created:
            _unlink_shm(self.name)


class MessageChannel:
    """One direction of one AICI channel. Both ends use the same class."""

    def __init__(self, name: str, size: int = 0, *, create: bool) -> None:
        self.name = name
        self.region = SharedRegion(name, size, create=create)
        wr, rd = name + "-wr", name + "-rd"
        if create:
            for sem in (wr, rd):
                _unlink_sem(sem)
            self.write_sem = posix_ipc.Semaphore(wr, flags=posix_ipc.O_CREX, initial_value=1)
            self.read_sem = posix_ipc.Semaphore(rd, flags=posix_ipc.O_CREX, initial_value=0)
        else:
            try:
                self.write_sem = posix_ipc.Semaphore(wr)
                self.read_sem = posix_ipc.Semaphore(rd)
            except posix_ipc.ExistentialError as e:
                raise FileNotFoundError(f"semaphore of channel {name} does not exist") from e
        self.closed = False

    def send(self, payload: bytes) -> None:
        if FRAME_HEADER + len(payload) > self.region.size:
            raise FrameError(
                f"message of {len(payload)} bytes does not fit channel {self.name} ({self.region.size} bytes)"
            )
        while True:
            try:
                self.write_sem.acquire()
                break
            except posix_ipc.SignalError:  # a timer signal (see _acquire_read): wait on
                continue
        write_frame(self.region.map, payload)
        self.read_sem.release()

    def recv(self, timeout: float | None = None, *, spin_s: float = 0.0) -> bytes | None:
        """The next message; None when `timeout` (seconds) passes first. The first `spin_s` of
        the wait spin instead of sleeping: a waiter that stays on its core answers in
        microseconds, where a woken one pays the scheduler and cold caches."""
        if not self._acquire_read(timeout, spin_s):
            return None
        try:
            n = frame_length(self.region.map, self.region.size)
            return bytes(self.region.map[FRAME_HEADER : FRAME_HEADER + n])
        finally:
            self.write_sem.release()

    def _acquire_read(self, timeout: float | None, spin_s: float) -> bool:
        sem = self.read_sem
        if spin_s > 0:
            now = time.monotonic()
            spin_end = now + (spin_s if timeout is None else min(spin_s, timeout))
            while True:
                # read the count (sem_getvalue: a plain load) until a message is there; only
                # then try to take it, so the spin allocates nothing and makes no system calls
                if not _VALUE_READABLE or sem.value > 0:
                    try:
                        sem.acquire(0)
                        return True
                    except posix_ipc.BusyError:
                        pass
                if self.closed:
                    raise ChannelClosed(self.name)
                if time.monotonic() >= spin_end:
                    break
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - now))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                sem.acquire(timeout)
                return True
            except posix_ipc.BusyError:
                return False
            except posix_ipc.SignalError:
                # found by the soak bench: the runtime's time-limit timer signal interrupts a
                # waiting side-channel thread, which died of it (every later instantiate hung)
                if deadline is not None:
                    timeout = max(0.0, deadline - time.monotonic())

    def close(self) -> None:
        self.closed = True
        self.region.close()
        for sem in (self.write_sem, self.read_sem):
            sem.close()
            if self.region.created:
                _unlink_sem(sem.name)


def remove_channels(prefix: str) -> None:
    """Unlink the shared memory and semaphores of a runtime's five objects (their creator, the
    engine, is gone and cannot); names absent already are skipped."""
    for role, name in channel_names(prefix).items():
        _unlink_shm(name + "-shm")
        if role != "bin":
            _unlink_sem(name + "-wr")
            _unlink_sem(name + "-rd")


_STALE_NAME = re.compile(r"^(?:sem\.)?tw(\d+)-([0-9a-f]{4})-")


def sweep_stale_channels(shm_dir: Path = Path("/dev/shm")) -> int:
    """Remove the channel sets (named by `pid_prefix`) whose creating engine is no longer
    running: an engine killed outright, whose runtime was killed too before it could remove
    them (Ray's raylet kills a dead worker's children). Returns how many sets were removed.
    Only Linux lists POSIX shared memory as files; elsewhere this does nothing."""
    if not shm_dir.is_dir():
        return 0
    stale = set()
    for path in shm_dir.iterdir():
        m = _STALE_NAME.match(path.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            stale.add(f"/tw{m.group(1)}-{m.group(2)}-")
    for prefix in stale:
        remove_channels(prefix)
    return len(stale)


def _unlink_shm(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _unlink_sem(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def pid_prefix(base: str = "/tw") -> str:
    """A short per-process prefix (macOS caps names at 31 characters: "/tw" + a pid of up to 7
    digits + "-xxxx-" + "resp-side-shm" is 29). The whole pid: `sweep_stale_channels` reads it."""
    return f"{base}{os.getpid()}-{os.urandom(2).hex()}-"
