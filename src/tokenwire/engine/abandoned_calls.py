"""Long model calls run in slices, one `EngineAPI.model_call` each (GraphPipe's dense passes,
embeddings), so the engine's steps run between them; a call whose caller went away stops before
its next layer. Only calls on this process's engine see the flag: under --replicas a cancelled
call stops between slices."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

_call_ids = itertools.count(1)
cancelled: set[int] = set()  # ids of calls whose caller went away


class CallAbandoned(Exception):
    """Raised in a cancelled call's forward; nobody awaits its result any more."""


def new_call_id() -> int:
    return next(_call_ids)


async def slice_result(future: Future[Any], call_id: int) -> Any:
    """The result of one slice of call `call_id`; cancelled, it flags the call so the slice
    running now stops before its next layer (and forgets the flag once that slice is over)."""
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        cancelled.add(call_id)
        future.add_done_callback(lambda _: cancelled.discard(call_id))
        raise


def layer_check(engine: Engine, call_id: int, what: str) -> Callable[[], None]:
    """A dense pass's before_layer: stops it at the server's shutdown or its caller's leaving."""

    def before_layer() -> None:
        engine.check_stopping()
        if call_id in cancelled:
            raise CallAbandoned(f"{what} call {call_id}: its client went away")

    return before_layer
