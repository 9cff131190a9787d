"""Keeping `serve --aici`'s runtime child alive: when it dies (a crash, the OOM killer, a
SIGKILL), the runs it was controlling fail with a clear error and a fresh runtime takes over.

The child's death is seen from both sides: a round waiting on the main channel notices the
exit within a second (AiciClient.recv_main) and fails that round's sequences ("AICI runtime:
... runtime exited with status -9"); this supervisor polls the process, fails the side-channel
calls still waiting (an instantiate or an upload would otherwise wait forever), starts a new
runtime with the same arguments and swaps it in. Runs that start meanwhile get 503 "AICI
runtime restarting". The old channels are closed once the runs that used them have ended.
Uploaded controllers and tags live in the store directory, so they survive the restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.engine_bridge import Coordinator

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

log = logging.getLogger("tokenwire.aici")
POLL_S = 0.2  # how often the child is checked: a restart begins within this of its death
RETRY_S = 5.0  # wait before trying again when a restart itself failed
# a runtime that owes a reply and has sent none for this long is stuck (alive, not answering):
# it is killed and restarted. Its own CPU watchdog (watchdog.py) ends a controller stuck in native
# code after its budget + 1 s of CPU; this covers the rest (a runtime stopped, deadlocked, or
# starved). Far above any legitimate wait: instantiate's budget is 1 s of CPU, a round's 25 ms
# per sequence, and replies to other commands keep a busy runtime from counting as stalled.
HANG_S = 20.0
# how long a new run waits for a restart before it is refused (503): a restart takes ~3-5 s
# (the runtime loads torch and the tokenizer)
RESTART_WAIT_S = 15.0


class Supervised(Protocol):
    """The server whose runtime is kept alive: AiciServer (rest.py), which makes its supervisor
    (described here so that this module need not import the one that imports it)."""

    engine: Engine
    client: AiciClient | None
    coord: Coordinator | None

    @property
    def shutting_down(self) -> bool: ...

    @property
    def runs(self) -> set[asyncio.Task[Any]]: ...


class RuntimeSupervisor:
    def __init__(self, server: Supervised, make_client: Callable[[], AiciClient]) -> None:
        self.server = server
        self.make_client = make_client
        self.restarts = 0
        self.restarting = False
        self._task: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[Any]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="aici-supervisor")

    def ready(self) -> bool:
        client = self.server.client
        return not self.restarting and client is not None and client.proc.poll() is None

    async def wait_ready(self, timeout_s: float = RESTART_WAIT_S) -> bool:
        """Wait (briefly) for a runtime that died to be replaced: a run that arrives during a
        restart starts on the new runtime instead of failing. False if not ready by then."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.ready():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(POLL_S)
            dead = self.server.client
            status = dead.proc.poll()
            if self.server.shutting_down:
                continue
            if status is None:
                stalled = dead.stalled_s()
                if stalled < HANG_S:
                    continue
                log.error(
                    "AICI runtime (pid %d) owes a reply and sent none for %.0f s: killing it",
                    dead.proc.pid,
                    stalled,
                )
                dead.kill()
                status = await loop.run_in_executor(None, dead.proc.wait)
            self.restarting = True
            log.error(
                "AICI runtime (pid %d) died with status %s: failing its runs, restarting",
                dead.proc.pid,
                status,
            )
            dead.fail_pending(f"AICI runtime died (exit status {status}); it is being restarted")
            runs = set(self.server.runs)
            old_coord = self.server.coord
            try:
                fresh = await loop.run_in_executor(None, self.make_client)
            except Exception:
                log.exception("AICI runtime restart failed; trying again in %.0f s", RETRY_S)
                await asyncio.sleep(RETRY_S)
                continue
            self.server.client = fresh
            self.server.coord = Coordinator.for_engine(fresh, self.server.engine)
            self.restarts += 1
            self.restarting = False
            log.info("AICI runtime restarted (pid %d, restart %d)", fresh.proc.pid, self.restarts)
            task = asyncio.create_task(self._retire(dead, old_coord, runs))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _retire(client: AiciClient, coord: Coordinator, runs: set[asyncio.Task[Any]]) -> None:
        """Close the dead runtime's channels once no run uses them."""
        if runs:
            await asyncio.wait(runs, timeout=60)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, coord.close)
        await loop.run_in_executor(None, client.close)
