"""Engine sessions behind one Evergreen session: the token sequences already computed.

Each finished GENERATE leaves its engine session (prompt + generated tokens, KV computed) in
the pool. A later action whose flattened input starts with one of those sequences forks it at
the longest common prefix (shared KV blocks, nothing recomputed) and appends only the new
tokens: the seed's turn 2 costs only its new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import SessionNotFoundError
from tokenwire.engine.request import FinishEvent, GenerateOptions, RequestHandle, stream_events
from tokenwire.engine.session import common_prefix
from tokenwire.engine.vision import ImageInput


@dataclass
class Lease:
    """One engine session an action works on; `tokens` mirrors the engine session's tokens."""

    engine: EngineAPI
    sid: str
    tokens: list[int]
    use_prefix_cache: bool = True

    def _align(self, target: Sequence[int]) -> list[int]:
        """Truncate to the common prefix with `target`; returns the tokens still to append."""
        keep = common_prefix(self.tokens, target)
        if keep < len(self.tokens):
            self.engine.truncate_session(self.sid, keep)
            del self.tokens[keep:]
        return list(target[keep:])

    async def prefill(self, target: Sequence[int], priority: int = 5) -> None:
        """Compute the KV of `target` (prefill only) while more input may still arrive."""
        append = self._align(target)
        if not append:
            return
        handle = self.engine.generate(
            self.sid,
            append,
            GenerateOptions(max_tokens=0, priority=priority, use_prefix_cache=self.use_prefix_cache),
        )
        self.tokens.extend(append)
        async for event in stream_events(handle):
            if isinstance(event, FinishEvent) and event.reason == "error":
                raise RuntimeError(event.error or "prefill failed")

    def start(
        self, prompt: Sequence[int], options: GenerateOptions, images: Sequence[ImageInput] = ()
    ) -> RequestHandle:
        """Generate after `prompt`; `images` (absolute positions in it) are attached on the way."""
        append = self._align(prompt[: images[0].start] if images else prompt)
        if images:  # the session now ends before the first image: every block is appended anew
            append = list(prompt[len(self.tokens) :])
        if not append and not self.tokens:
            raise ValueError("empty prompt")
        options.use_prefix_cache = self.use_prefix_cache
        handle = self.engine.generate(self.sid, append, options, images=images)
        self.tokens.extend(append)
        return handle


class EngineSessions:
    def __init__(self, engine: EngineAPI, max_kept: int = 8, *, reuse: bool = True) -> None:
        """reuse=False (benchmarks): every action starts a fresh engine session, prefix cache off."""
        self.engine = engine
        self.reuse = reuse
        self.max_kept = max_kept
        self.kept: list[tuple[str, list[int]]] = []  # idle computed sequences, oldest first
        self.leased: set[str] = set()

    def acquire(self, tokens: Sequence[int]) -> Lease:
        best, best_len = None, 0
        for sid, seq in self.kept if self.reuse else []:
            n = common_prefix(seq, tokens)
            if n > best_len:
                best, best_len = sid, n
        sid = None
        if best is not None:
            try:
                sid = self.engine.fork_session(best, at=best_len)
            except SessionNotFoundError:  # expired in the engine: forget it
                self.kept = [(s, t) for s, t in self.kept if s != best]
        if sid is None:
            sid, best_len = self.engine.create_session(()), 0
        self.leased.add(sid)
        return Lease(self.engine, sid, list(tokens[:best_len]), use_prefix_cache=self.reuse)

    def keep(self, lease: Lease) -> None:
        """The action is done: keep its sequence for later actions to extend."""
        self.leased.discard(lease.sid)
        try:
            tokens = self.engine.session_tokens(lease.sid)
        except SessionNotFoundError:
            return
        self.kept.append((lease.sid, tokens))
        while len(self.kept) > self.max_kept:
            sid, _ = self.kept.pop(0)
            self.engine.close_session(sid)

    def discard(self, lease: Lease) -> None:
        self.leased.discard(lease.sid)
        self.engine.close_session(lease.sid)

    def close(self) -> None:
        for sid, _ in self.kept:
            self.engine.close_session(sid)
        for sid in self.leased:
            self.engine.close_session(sid)
        self.kept.clear()
        self.leased.clear()
