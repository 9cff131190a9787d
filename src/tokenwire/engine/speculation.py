"""Prompt-lookup (n-gram) speculation: more than one token per read of the weights.

A decoding request's next tokens are guessed from its own context: the latest earlier place
where the context's last 3 (else 2, else 1) tokens occurred, and the tokens that followed
there. The scheduler runs the guesses in the request's step as extra rows after its last
token (the prefill path over the paged KV); postprocess samples each row in turn and keeps
guesses while they are what the sampler picks, so a step yields 1 + the accepted guesses.

Exact: every step of a fused model runs one arithmetic whatever its rows (the batch
invariance of kernels/matvec.h and paged_attention.h), so a row's logits here are the bits a
one-token step gives; greedy output and logprobs are the same with and without speculation.
With sampling, a guess is a point-mass draft: kept with probability p(guess), else the token is
drawn from p without it (rejection sampling keeps the model's distribution; sampler.py).
The KV of rejected rows is never marked computed, and the next step overwrites it.

Adaptive: a request whose guesses keep failing stops guessing for a while (1, 2, 4 ... 64
steps), and the number of guesses follows the accepted length, so free text costs little.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATE = ("off", "ngram")  # --speculate; a draft model (--draft-model) is not built yet
MAX_NGRAM = 3
MAX_GUESSES = 8
MIN_GUESSES = 2


@dataclass
class SpecStats:
    """The engine's totals (stats(), /metrics)."""

    proposed: int = 0  # guessed tokens run through the model
    accepted: int = 0  # guesses kept
    verifications: int = 0  # steps of a request that carried guesses
    verified_tokens: int = 0  # tokens those steps produced (accepted + one sampled each)


class Speculator:
    """One request's guesses: an index of its context's n-grams and the adaptive state."""

    def __init__(self) -> None:
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self._seen: list[int] = []  # the tokens indexed (to notice a rewrite: backtrack, truncate)
        self.guesses = 4
        self._misses = 0
        self._paused = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` guesses of the tokens after `tokens` (none while paused)."""
        if limit <= 0:
            return []
        if self._paused:
            self._paused -= 1
            return []
        self._update(tokens)
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            after = self._index.get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after : after + min(limit, self.guesses)]
        return []

    def verified(self, proposed: int, accepted: int) -> None:
        if accepted == 0:
            self._misses += 1
            self._paused = 2 ** min(self._misses - 1, 6) - 1
            self.guesses = MIN_GUESSES
            return
        self._misses = 0
        if accepted == proposed:
            self.guesses = min(MAX_GUESSES, 2 * self.guesses)
        else:
            self.guesses = max(MIN_GUESSES, accepted + 1)

    def _update(self, tokens: list[int]) -> None:
        """Index the n-grams that have a following token (the last position has none yet)."""
        end = len(tokens) - 1
        tail = max(0, self._indexed - 8)  # a rewrite (backtrack, truncate) shows at the end; a
        # stale entry elsewhere only costs a failed guess, never a wrong token
        if end < self._indexed or tokens[tail : self._indexed] != self._seen[tail:]:
            self._index, self._indexed, self._seen = {}, 0, []
        for p in range(self._indexed, end):  # n-grams ending at p, followed by p + 1
            for n in range(1, min(MAX_NGRAM, p + 1) + 1):
                self._index[tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self._seen.extend(tokens[self._indexed : end])
        self._indexed = max(self._indexed, end)
