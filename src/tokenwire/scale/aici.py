"""AICI under `--replicas`: each replica runs its own AICI runtime beside its engine.

AICI controllers steer every token from beside the model thread (a round of pre/mid/post over
shared memory per engine step), so a controller cannot run in the ingress process while its
tokens are computed in a replica. Instead a whole `/v1/run` runs in one replica: the ingress
picks the least-loaded replica, calls its `aici_run` streaming generator, and forwards each run
object (initial-run, forks' text, logs, the end) as the replica produces it. The replica starts
its runtime child (`tokenwire aicirt`, the same as `serve --aici` starts) on first use, with the
flags the ingress was given, and starts a fresh one when it finds the last one dead.

Uploaded controllers and tags go to every live replica's runtime (the store directory keeps
them across runtime restarts); a replica started later on another machine sees what its own
store directory holds (a shared --aici-store-dir gives every replica every module).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tokenwire.engine.errors import ReplicaLostError
from tokenwire.protocols.aici.client import AiciClient, AiciError
from tokenwire.protocols.aici.engine_bridge import Coordinator
from tokenwire.protocols.aici.rest import runtime_spin_ms, tokenizer_spec
from tokenwire.protocols.aici.run import failed_run, run_events
from tokenwire.scale.handle import _lost_errors

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine
    from tokenwire.protocols.aici.run import RunRequest

log = logging.getLogger("tokenwire.scale")


class RuntimeConfig:
    """What the ingress was told about the AICI runtime (serve's --aici-* flags)."""

    def __init__(self, runtime_args: list[str], busy_wait_ms: float | None) -> None:
        self.runtime_args = list(runtime_args)
        self.busy_wait_ms = busy_wait_ms  # None: 200 ms on a GPU, 0 on the CPU (rest.py's rule)


# ---------------------------------------------------------------------------------- replica side
class ReplicaAici:
    """The AICI runtime of one replica (lives in the replica actor's process)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.client: AiciClient | None = None
        self.coord: Coordinator | None = None
        self._retired: list[tuple[AiciClient, Coordinator]] = []
        self._lock = asyncio.Lock()

    async def _runtime(self, config: RuntimeConfig) -> tuple[AiciClient, Coordinator]:
        async with self._lock:
            if self.client is not None and self.coord is not None:
                status = self.client.proc.poll()
                if status is None:
                    return self.client, self.coord
                log.error("AICI runtime (pid %d) died with status %s; starting another",
                          self.client.proc.pid, status)  # fmt: skip
                self.client.fail_pending(f"AICI runtime died (exit status {status})")
                self._retired.append((self.client, self.coord))  # its runs end on their own
            engine = self.engine
            spin = runtime_spin_ms(config.busy_wait_ms, engine)
            loop = asyncio.get_running_loop()
            self.client = await loop.run_in_executor(
                None,
                lambda: AiciClient(
                    tokenizer=tokenizer_spec(engine), runtime_args=config.runtime_args, busy_wait_ms=spin
                ),
            )
            self.coord = Coordinator.for_engine(self.client, engine)
            return self.client, self.coord

    async def side(self, config: RuntimeConfig, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        client, _ = await self._runtime(config)
        return await client.side_async(op, **fields)

    async def run(self, config: RuntimeConfig, req: RunRequest) -> AsyncIterator[dict[str, Any]]:
        client, coord = await self._runtime(config)
        events = run_events(self.engine, client, coord, req)
        try:
            async for obj in events:
                yield obj
        finally:  # cancelled (the client went away): the forks stop, their sessions close
            await events.aclose()

    def close(self) -> None:
        pairs = self._retired + ([(self.client, self.coord)] if self.client and self.coord else [])
        for client, coord in pairs:
            coord.close()
            client.close()
        self._retired.clear()
        self.client = self.coord = None


# ---------------------------------------------------------------------------------- ingress side
class ReplicaPool(Protocol):
    """What RemoteAici uses of the ingress's engine: ReplicaEngine (facade.py), which makes it
    (described here so that this module need not import the one that imports it)."""

    replicas: list[Any]  # the replica actors
    up: list[bool]

    def _place(self, tokens: Sequence[int]) -> int: ...

    def replica_lost(self, replica: int, exc: BaseException | None = None) -> None: ...


class RemoteAici:
    """What the AICI REST server uses instead of a local runtime under `--replicas`."""

    def __init__(self, engine: ReplicaPool, config: RuntimeConfig) -> None:
        self.engine = engine
        self.config = config

    def describe(self) -> str:
        return f"one per engine replica ({len(self.engine.replicas)})"

    async def side(self, op: str, **fields: Any) -> dict[str, Any]:
        """get_tags asks one replica; an upload or a tag goes to every live replica (all must
        accept it: a run may land on any of them). Raises AiciError as a local runtime would."""
        live = [r for r in range(len(self.engine.replicas)) if self.engine.up[r]]
        if not live:
            raise AiciError("no engine replica is up (all are restarting)")
        targets = live[:1] if op == "get_tags" else live
        calls = [self.engine.replicas[r].aici_side.remote(self.config, op, fields) for r in targets]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for r, reply in zip(targets, replies, strict=True):
            if isinstance(reply, BaseException):
                if isinstance(reply, _lost_errors()):
                    self.engine.replica_lost(r, reply)
                    raise AiciError(f"engine replica {r} was lost during {op}; retry") from None
                cause = getattr(reply, "cause", None)
                raise AiciError(str(cause) if isinstance(cause, AiciError) else _cause_text(reply)) from None
        return replies[0]

    async def run(self, req: RunRequest) -> AsyncIterator[dict[str, Any]]:
        """The run's objects as the chosen replica produces them; a replica lost mid-run ends
        the run with a failed fork naming the loss."""
        # local: ray is optional (the `ray` extra); this module is imported by every replica's set-up
        import ray

        try:
            replica = self.engine.place(())
        except ReplicaLostError as exc:
            yield failed_run(str(exc))
            return
        actor = self.engine.replicas[replica]
        stream = actor.aici_run.options(num_returns="streaming").remote(self.config, req)
        finished = False
        try:
            async for ref in stream:
                yield await ref
            finished = True
        except _lost_errors() as exc:
            finished = True
            self.engine.replica_lost(replica, exc)
            yield failed_run(
                f"engine replica {replica} was lost mid-run ({type(exc).__name__}); run it again"
            )
        except ray.exceptions.RayTaskError as exc:
            finished = True
            yield failed_run(f"internal error on engine replica {replica}: {_cause_text(exc)}")
        finally:
            if not finished:  # the client went away or the server stops: stop it on the replica
                ray.cancel(stream)


def _cause_text(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
