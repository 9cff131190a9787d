"""The session -> replica map, in one place every ingress process reaches: a named Ray actor.

A session never moves (its KV lives in one replica), so an entry is written once, when the
session or fork is made, and removed when it is closed; ingress processes cache lookups
(facade.py) and come here on a miss. Each entry also records the replica's incarnation (a new
one per actor (re)start): a session whose replica has since restarted is reported as lost with
the replica, not as "not found".

`SessionTable` is the plain data structure (the routing simulator measures its memory at a
million sessions); `SessionDirectory` is the actor around it.
"""

from __future__ import annotations

from tokenwire.scale.actors import find_replicas


class SessionTable:
    """session id -> (replica index, incarnation number), incarnations numbered per table."""

    def __init__(self) -> None:
        # one int per entry (replica << 20 | incarnation number): ~4x smaller than a tuple value
        self._entries: dict[str, int] = {}
        self._incarnations: dict[str, int] = {}  # incarnation id -> number
        self._names: list[str] = []  # number -> incarnation id

    def _number(self, incarnation: str) -> int:
        n = self._incarnations.get(incarnation)
        if n is None:
            n = self._incarnations[incarnation] = len(self._names)
            self._names.append(incarnation)
        return n

    def assign(self, session_id: str, replica: int, incarnation: str) -> None:
        self._entries[session_id] = replica << 20 | self._number(incarnation)

    def lookup(self, session_id: str) -> tuple[int, str] | None:
        value = self._entries.get(session_id)
        if value is None:
            return None
        return value >> 20, self._names[value & 0xFFFFF]

    def remove(self, session_id: str) -> bool:
        return self._entries.pop(session_id, None) is not None

    def forget(self, session_ids: list[str]) -> int:
        """Drop sessions that ended on their replica (expired there, or closed by a path that did
        not come through an ingress). Returns how many were known."""
        return sum(self._entries.pop(sid, None) is not None for sid in session_ids)

    def __len__(self) -> int:
        return len(self._entries)

    def per_replica(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for value in self._entries.values():
            counts[value >> 20] = counts.get(value >> 20, 0) + 1
        return counts


class SessionDirectory:
    """The Ray actor (decorated in cluster.py): every method is one dict operation.

    Ray restarts it when it dies (max_restarts=-1), running __init__ again: the new one asks
    every replica of its namespace for the sessions it holds, so open sessions keep their place
    (at first start there are no replicas yet, and nothing to ask)."""

    def __init__(self) -> None:
        self.table = SessionTable()
        self._recover()

    def _recover(self) -> None:
        # local: ray is optional (the `ray` extra); this runs inside the Ray actor
        import ray

        for index, actor in find_replicas(ray.get_runtime_context().namespace):
            try:
                incarnation, sessions = ray.get(actor.sessions.remote(), timeout=30)
            except Exception:  # a replica down now holds no sessions to find
                continue
            for session_id in sessions:
                self.table.assign(session_id, index, incarnation)

    def assign(self, session_id: str, replica: int, incarnation: str) -> None:
        self.table.assign(session_id, replica, incarnation)

    def assign_many(self, session_ids: list[str], replica: int, incarnation: str) -> None:
        """A replica's sessions at once: those it restored from its state dir at start."""
        for session_id in session_ids:
            self.table.assign(session_id, replica, incarnation)

    def lookup(self, session_id: str) -> tuple[int, str] | None:
        return self.table.lookup(session_id)

    def remove(self, session_id: str) -> bool:
        return self.table.remove(session_id)

    def forget(self, session_ids: list[str]) -> int:
        return self.table.forget(session_ids)

    def counts(self) -> dict[int, int]:
        return self.table.per_replica()

    def size(self) -> int:
        return len(self.table)
