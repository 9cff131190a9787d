"""A bounded LRU cache of encoded responses, keyed by a hash of model name + request bytes.

Like the response cache of Oracle's Go server (there a bolt database keyed by the request),
but in memory and bounded by total bytes; off unless --graphpipe-cache-mb is set. Only
successful responses are stored: errors are cheap to recompute and may be transient.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


class ResponseCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()

    @staticmethod
    def key(model: str, body: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(model.encode("utf-8"), digest_size=32)
        h.update(b"\0")
        h.update(body)
        return h.digest()

    def get(self, key: bytes) -> bytes | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: bytes, value: bytes) -> None:
        if len(value) > self.max_bytes or key in self._items:
            return
        self._items[key] = value
        self.bytes += len(value)
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)

    def __len__(self) -> int:
        return len(self._items)
