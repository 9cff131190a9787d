"""Prompt-lookup (n-gram) speculation: more than one token per read of the weights.

A decoding request's next tokens are guessed from its own context: the latest earlier place
where the context's last 3 (else 2, else 1) tokens occurred, and the tokens that followed
there. The scheduler runs the guesses in the request's step as extra rows after its last
token (the prefill path over the paged KV); postprocess samples each row in turn and keeps
guesses while they are what the sampler picks, so a step yields 1 + the accepted guesses.

Exact: every step of a fused model runs one arithmetic whatever its rows (the batch
invariance of kernels/matvec.h and paged_attention.h), so a row's logits here are the bits a
one-token step gives; greedy output and logprobs are the same with and without speculation.
With sampling, a guess is a point-mass draft: the row's token is drawn from p as without guesses
and the guess is kept when the draw is the guess, which is rejection sampling for such a draft
(kept with probability p(guess)); a seeded request then samples the same tokens with and
without speculation (sampler.py).
The KV of rejected rows is never marked computed, and the next step overwrites it.

Worth it or not: a guess costs a row of the step, and on a CPU a row is not free (SmolLM2 on 2
cores: a decode step of 1 row 3.1 ms, each more row +1.25 ms: the int16 kernels are compute
bound there; at 1B and up the weights' bytes dominate and rows are nearly free). `StepCost` fits
step time = fixed + per_row * rows from the engine's own decode steps; a guess is made only while
its chance of being kept (the request's measured chance of keeping a first guess, then each next
one) beats what its row costs against the step's other rows. A request below that guesses one
token now and then (1, 2, 4 ... 64 steps apart) to keep its estimate current.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATE = ("off", "ngram", "draft")  # --speculate; draft: a draft model's guesses (engine/draft.py)
MAX_NGRAM = 3
MAX_GUESSES = 8


@dataclass
class SpecStats:
    """The engine's totals (stats(), /metrics)."""

    proposed: int = 0  # guessed tokens run through the model
    accepted: int = 0  # guesses kept
    verifications: int = 0  # steps of a request that carried guesses (each: its kept + 1 token)


class StepCost:
    """Step time = fixed + per_row * rows, fitted over recent decode steps (exponentially
    weighted least squares); until the rows have varied, a prior of per_row = 0.4 fixed (what
    SmolLM2 measures on 2 cores: the cautious end)."""

    DECAY = 0.98

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def per_row_share(self, rows: int) -> float:
        """What one more row costs as a share of a step's time per row it already has: the
        chance a guess must have of being kept to pay for its row in a step of `rows` rows."""
        var = self._n * self._xx - self._x * self._x
        fixed, per_row = 1.0, 0.4
        if self._n >= 8 and var > 1e-9 * max(1.0, self._n * self._xx):
            slope = (self._n * self._xy - self._x * self._y) / var
            intercept = (self._y - slope * self._x) / self._n
            if slope > 0 and intercept > 0:
                fixed, per_row = intercept, slope
        return min(1.0, per_row * rows / (fixed + per_row * rows))


class Speculator:
    """One request's guesses: an index of its context's n-grams, and its chances of a first
    guess being kept and of each next one being kept after a kept one."""

    PRIOR_FIRST, PRIOR_NEXT, WEIGHT = 0.6, 0.8, 0.2

    def __init__(self) -> None:
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self._seen: list[int] = []  # the tokens indexed (to notice a rewrite: backtrack, truncate)
        self.first = self.PRIOR_FIRST
        self.next = self.PRIOR_NEXT
        self._misses = 0
        self._paused = 0
        self.proposed = 0  # this request's guesses run, and kept (the access log's line)
        self.accepted = 0

    def guesses(self, threshold: float) -> int:
        """How many guesses pay for their rows: guess i is kept with chance first * next^(i-1)."""
        if self.first <= threshold:
            return 0
        count, chance = 1, self.first * self.next
        while count < MAX_GUESSES and chance > threshold:
            count, chance = count + 1, chance * self.next
        return count

    def to_guess(self, limit: int, threshold: float) -> int:
        """How many guesses to make now (at most `limit`): as many as pay for their rows, else
        now and then one, a probe that keeps the estimate current (0: none this step)."""
        if limit <= 0:
            return 0
        count = self.guesses(threshold)
        if count == 0:
            if self._paused:
                self._paused -= 1
                return 0
            count = 1
        return min(limit, count)

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        """Up to `limit` guesses of the tokens after `tokens`, as many as pay for their rows in
        a step where a row must be kept with chance `threshold` (StepCost); while guessing does
        not pay, one guess now and then."""
        count = self.to_guess(limit, threshold)
        if count == 0:
            return []
        self._update(tokens)
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            after = self._index.get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after : after + count]
        return []

    def close(self) -> None:
        """The request is over (a draft model's session is closed: engine/draft.py)."""

    def verified(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        w = self.WEIGHT
        self.first += w * ((accepted > 0) - self.first)
        for i in range(1, min(accepted + 1, proposed)):  # guesses after a kept one
            self.next += w * ((i < accepted) - self.next)
        if accepted == 0:
            self._misses += 1
            self._paused = 2 ** min(self._misses - 1, 6) - 1
        else:
            self._misses = 0

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
