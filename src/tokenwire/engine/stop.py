"""Incremental stop-string detection over streamed, decoded generated text."""

from __future__ import annotations

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Detects the first occurrence of any stop string in text that arrives in pieces.

    Feed the decoded text of each generated token (or any chunking of it) with :meth:`feed`.
    Stops that span chunk boundaries are found. Only a tail window of ``max(len(stop)) - 1``
    characters of earlier text is kept, so each call costs O(len(chunk) + max stop length)
    per stop string.

    Offsets are indices into the concatenation of everything fed so far ("generated text").
    :meth:`feed` returns the index where the matched stop string **begins**, so the output to
    keep is ``generated_text[:index]`` (the stop string itself is excluded); the index where it
    ends is :attr:`match_end`.

    "First" means the match that completes earliest in the text, so the result does not depend
    on how the text was chunked; among matches ending at the same position the longest stop
    wins (e.g. stops ``["b", "ab"]`` on ``"xab"`` -> begins at 1).
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops: list[str] = list(dict.fromkeys(stops))  # dedupe, keep order
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        self.reset()

    def reset(self) -> None:
        """Forget all fed text."""
        self._tail = ""  # last <= _keep characters fed
        self._total = 0  # characters fed so far
        self._holdback = 0
        self.match_start: int | None = None
        self.match_end: int | None = None
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        """True once a stop string has been found (further feeds are ignored)."""
        return self.match_start is not None

    @property
    def total_len(self) -> int:
        """Number of characters fed so far."""
        return self._total

    @property
    def safe_len(self) -> int:
        """Length of the generated-text prefix that can be streamed to a client now.

        Before a match, the longest suffix that is a proper prefix of some stop string is held
        back (it may turn into a stop); after a match, it is :attr:`match_start`.
        """
        if self.match_start is not None:
            return self.match_start
        return self._total - self._holdback

    def feed(self, text: str) -> int | None:
        """Append ``text``; return the begin index of the first stop string, or None.

        Once a stop was found, returns that same index for every later call without scanning.
        """
        if self.match_start is not None:
            return self.match_start
        if not self.stops:
            self._total += len(text)
            return None
        window = self._tail + text
        base = self._total - len(self._tail)  # generated-text offset of window[0]
        n_old = len(self._tail)
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stops:
            # only matches ending inside the new text; older ones were already ruled out
            i = window.find(s, max(0, n_old - len(s) + 1))
            if i >= 0:
                cand = (i + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        self._total += len(text)
        if best is not None:
            end, _, s = best
            self.match_end = base + end
            self.match_start = self.match_end - len(s)
            self.matched = s
            return self.match_start
        self._tail = window[-self._keep :] if self._keep else ""
        self._holdback = self._partial_suffix(window)
        return None

    def _partial_suffix(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(window)), best, -1):
                if window.endswith(s[:k]):
                    best = k
                    break
        return best
