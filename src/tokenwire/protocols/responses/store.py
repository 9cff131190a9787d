"""Stored responses: by id, each owned by the API key that made it, bounded.

A stored response keeps its object, the input items of its chain (for input_items) and the
engine session holding its conversation's tokens and KV (what previous_response_id continues).
The store holds at most `capacity` responses (half of --max-sessions; 1024 without it), least
recently used evicted first, and forgets a response idle for `ttl_s` (--session-ttl, the
lifetime of its session too); dropping a response closes its session (`release`). A response of
another key reads as absent: the same 404 as an unknown id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.security import owner_of as owner_of  # the owner digest, shared

DEFAULT_CAPACITY = 1024


@dataclass
class Stored:
    id: str
    owner: str
    session: str | None
    response: dict[str, Any]
    items: list[dict[str, Any]]  # the chain's input items, oldest first: earlier turns', then this one's
    last_used: float = field(default_factory=time.monotonic)

    def chain(self) -> list[dict[str, Any]]:
        """The items a response continuing this one has before its own input."""
        return [*self.items, *self.response["output"]]


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    what = "previous response" if param == "previous_response_id" else "response"
    return OpenAIError(
        404,
        f"{what} {response_id!r} not found (never stored, deleted, expired, or made with another API key)",
        type="not_found_error",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


class ResponseStore:
    def __init__(
        self,
        capacity: int,
        ttl_s: float | None,
        release: Callable[[str], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = max(1, capacity)
        self.ttl_s = ttl_s
        self.release = release  # closes a session
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, response_id: str) -> Stored | None:
        stored = self._items.pop(response_id, None)
        if stored is not None and stored.session is not None:
            self.release(stored.session)
        return stored

    def expire(self) -> None:
        """Forget the responses idle longer than ttl_s (the least recently used come first)."""
        if self.ttl_s is None:
            return
        now = self.clock()
        while self._items:
            oldest = next(iter(self._items.values()))
            if now - oldest.last_used <= self.ttl_s:
                return
            self._drop(oldest.id)

    def put(self, stored: Stored) -> None:
        self.expire()
        while len(self._items) >= self.capacity:
            self.evict_oldest()
        stored.last_used = self.clock()
        self._items[stored.id] = stored

    def evict_oldest(self, keep: str | None = None) -> bool:
        """Drop the least recently used response but `keep` (and close its session); False when
        there is none to drop."""
        victim = next((rid for rid in self._items if rid != keep), None)
        if victim is None:
            return False
        self._drop(victim)
        return True

    def get(self, response_id: str, owner: str, param: str | None = None) -> Stored:
        """The response, if it exists and belongs to `owner`; else the 404 of an unknown id."""
        self.expire()
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise not_found(response_id, param)
        stored.last_used = self.clock()
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        self.get(response_id, owner)
        self._drop(response_id)

    def forget(self, response_id: str) -> None:
        """Drop a response whose session the engine no longer has."""
        self._drop(response_id)

    def clear(self) -> None:
        while self.evict_oldest():
            pass
