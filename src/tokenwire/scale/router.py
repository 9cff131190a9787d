"""Where a new session or a session-less request goes: the least-loaded live replica, optionally
the one that already holds the prompt's longest prefix. Pure Python + numpy, no Ray: the serve
process and the routing simulator (bench/scale_sim.py) drive this same class.

Load of a replica = its queued + running tokens (prompt tokens still to compute plus tokens still
to generate, as the replica last reported them, plus what this router sent it since), with a
penalty for a fuller KV cache (`KV_WEIGHT` tokens at 100% used), so near-ties go to the replica
with free blocks. A session's later calls and forks never come here: they follow the session map.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KV_WEIGHT = 256.0  # tokens of load that a full KV cache counts as
SESSION_WEIGHT = 1.0  # tokens of load per open session: idle sessions spread instead of piling up
PREFIX_BLOCK = 16  # tokens per prefix key (the engine's KV block size)
PREFIX_BLOCKS = 8  # prefix keys per prompt: the first 8 blocks (128 tokens) decide placement


def prefix_keys(tokens: Sequence[int], block: int = PREFIX_BLOCK, limit: int = PREFIX_BLOCKS) -> list[bytes]:
    """Chained hashes of the prompt's leading full blocks, shortest prefix first (as the engine's
    prefix cache keys its blocks: a key names the whole prefix up to the end of its block)."""
    keys: list[bytes] = []
    h = b""
    for i in range(min(len(tokens) // block, limit)):
        chunk = ",".join(map(str, tokens[i * block : (i + 1) * block])).encode()
        h = hashlib.blake2b(h + chunk, digest_size=8).digest()
        keys.append(h)
    return keys


@dataclass
class Placement:
    replica: int
    prefix_hit: bool  # placed on the replica remembered for one of the prompt's prefixes


class Router:
    """Replica loads (reported + dispatched) and a bounded prefix -> replica index."""

    def __init__(
        self,
        replicas: int,
        *,
        prefix_aware: bool = True,
        balance_slack: float = 512.0,
        prefix_capacity: int = 1_000_000,
        session_weight: float = SESSION_WEIGHT,
    ) -> None:
        self.tokens = np.zeros(replicas, dtype=np.float64)  # queued + running tokens
        self.used = np.zeros(replicas, dtype=np.float64)  # KV fraction in use, 0..1
        self.up = np.ones(replicas, dtype=bool)
        self.sessions = np.zeros(replicas, dtype=np.int64)
        self.prefix_aware = prefix_aware
        # a prefix hit is taken only while its replica's load is within this many tokens of the
        # least-loaded one: past that, recomputing the prefix elsewhere is cheaper than queueing
        self.balance_slack = balance_slack
        self.prefix_capacity = prefix_capacity
        self.session_weight = session_weight
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.tokens)

    def _scores(self) -> np.ndarray:
        score = self.tokens + KV_WEIGHT * self.used + self.session_weight * self.sessions
        return np.where(self.up, score, np.inf)

    def place(self, prefix: Sequence[bytes] = ()) -> Placement:
        """The replica for a new session or request; raises LookupError when none is up."""
        score = self._scores()
        best = int(np.argmin(score))
        if not np.isfinite(score[best]):
            raise LookupError("no replica is up")
        chosen, hit = best, False
        if self.prefix_aware:
            for key in reversed(prefix):  # longest prefix first
                r = self._prefixes.get(key)
                if r is not None and score[r] <= score[best] + self.balance_slack:
                    chosen, hit = r, True
                    break
        if prefix:
            self.remember(prefix, chosen)
        return Placement(chosen, hit)

    def remember(self, prefix: Sequence[bytes], replica: int) -> None:
        for key in prefix:
            self._prefixes[key] = replica
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.prefix_capacity:
            self._prefixes.popitem(last=False)

    # ------------------------------------------------------------------ load bookkeeping
    def dispatched(self, replica: int, tokens: float) -> None:
        """This router sent `tokens` of work to `replica` (until its next report says otherwise)."""
        self.tokens[replica] += tokens

    def opened(self, replica: int, sessions: int = 1) -> None:
        self.sessions[replica] = max(0, self.sessions[replica] + sessions)

    def finished(self, replica: int, tokens: float) -> None:
        self.tokens[replica] = max(0.0, self.tokens[replica] - tokens)

    def report(self, replica: int, tokens: float, free_blocks: int, total_blocks: int, sessions: int) -> None:
        """A replica's own numbers replace the estimate."""
        self.tokens[replica] = tokens
        self.used[replica] = 1.0 - free_blocks / total_blocks if total_blocks else 0.0
        self.sessions[replica] = sessions

    def report_all(self, tokens: np.ndarray, used: np.ndarray, sessions: np.ndarray) -> None:
        """Every replica's report at once (the routing simulator's replicas report together)."""
        self.tokens[:] = tokens
        self.used[:] = used
        self.sessions[:] = sessions

    def set_up(self, replica: int, up: bool) -> None:
        self.up[replica] = up
        if not up:
            self.tokens[replica] = 0.0
            self.sessions[replica] = 0
            self.forget_replica(replica)

    def forget_replica(self, replica: int) -> None:
        """A lost replica's KV is gone: its prefixes must not attract new sessions."""
        for key in [k for k, r in self._prefixes.items() if r == replica]:
            del self._prefixes[key]

    def imbalance(self) -> float:
        """max / mean load over the live replicas (1.0 = perfectly even)."""
        live = self.tokens[self.up]
        mean = float(live.mean()) if len(live) else 0.0
        return float(live.max()) / mean if mean > 0 else 1.0
