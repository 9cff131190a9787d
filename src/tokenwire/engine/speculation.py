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
bound there; at 1B and up the weights' bytes dominate and rows are nearly free), and a row
attends its whole context: at 8k that is most of its cost. `StepCost` fits step time from the
engine's own decode steps (rows, the positions they attend, the cache they read); a guess is
made only while its chance of being kept (the request's measured chance of keeping a first
guess, then each next one) beats what its row, attention included, costs against the step's
other rows. A request below that guesses one
token now and then (1, 2, 4 ... 64 steps apart) to keep its estimate current.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

SPECULATE = ("off", "ngram", "draft")  # --speculate; draft: a draft model's guesses (engine/draft.py)
MAX_NGRAM = 3
MAX_GUESSES = 8


@dataclass
class SpecStats:
    """The engine's totals (stats(), /metrics)."""

    proposed: int = 0  # guessed tokens run through the model
    accepted: int = 0  # guesses kept
    verifications: int = 0  # steps of a request that carried guesses (each: its kept + 1 token)


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on: its rows, the positions they attend in all (each row its
    whole context: the attention's arithmetic), and the positions of cache read (each sequence's
    context once: rows of one sequence share the reads, kernels/paged_attention.h)."""

    rows: int
    positions: int
    read: int

    @staticmethod
    def decodes(contexts: list[int]) -> StepShape:
        """A step of one decode row per sequence, attending `contexts` positions each."""
        total = sum(contexts)
        return StepShape(len(contexts), total, total)


class StepItemLike(Protocol):
    """What step_shape reads of a step's items (engine/step.py's StepItem)."""

    start: int
    count: int


def step_shape(items: Sequence[StepItemLike]) -> StepShape:
    """A step's shape: item positions [start, start + count), row p attending p + 1 positions."""
    positions = sum(i.count * i.start + i.count * (i.count + 1) // 2 for i in items)
    return StepShape(sum(i.count for i in items), positions, sum(i.start + i.count for i in items))


class StepCost:
    """Step time = fixed + per_row * rows + per_position * positions + per_read * read (StepShape),
    fitted over recent decode steps (exponentially weighted least squares, a weak prior).

    A guess's row pays its matmuls (per_row) and its attention over its whole context
    (per_position * context); at long context the attention is most of it: SmolLM2 on 2 cores
    (AVX2 build, fp16 KV), an extra row of one sequence costs ~1.3 ms at 100 positions and ~7 ms
    at 8k (kernels/paged_attention.h: 0.19 ms a layer a row at 8k, 30 layers; the cache is read
    once for the rows of a sequence, 0.39 ms a layer), against a 1-row step of ~3.1 ms short and
    ~15 ms at 8k. Counting a guess as a short row there made 8k decode with guesses run at half
    the speed of decode without (issue 45, at 4k: 13 vs 27 tok/s, when each row read the cache).

    The prior is those figures' shape (PRIOR, seconds), scaled to the steps observed: a bigger
    model's steps scale it, and the fit moves it where the steps' shapes tell the terms apart
    (rows varying at one context: per_row + per_position * context; contexts varying: the rest).
    """

    DECAY = 0.98
    # fixed, per_row, per_position, per_read: SmolLM2 on 2 cores (see above)
    PRIOR = (1.85e-3, 1.25e-3, 0.72e-6, 0.35e-6)
    PRIOR_WEIGHT = 0.01  # see coefficients()

    def __init__(self) -> None:
        k = len(self.PRIOR)
        self._xx = [[0.0] * k for _ in range(k)]  # decayed sums of x x^T, x y, y, prior's x.beta
        self._xy = [0.0] * k
        self._n = self._y = self._prior_y = 0.0

    @staticmethod
    def _features(shape: StepShape) -> list[float]:
        return [1.0, float(shape.rows), float(shape.positions), float(shape.read)]

    def observe(self, shape: StepShape, seconds: float) -> None:
        d, x = self.DECAY, self._features(shape)
        for i, xi in enumerate(x):
            self._xy[i] = d * self._xy[i] + xi * seconds
            for j, xj in enumerate(x):
                self._xx[i][j] = d * self._xx[i][j] + xi * xj
        self._n = d * self._n + 1
        self._y = d * self._y + seconds
        self._prior_y = d * self._prior_y + sum(b * xi for b, xi in zip(self.PRIOR, x, strict=True))

    def coefficients(self) -> tuple[float, ...]:
        """(fixed, per_row, per_position, per_read), each >= 0; the prior's shape until observed."""
        k = len(self.PRIOR)
        scale = self._y / self._prior_y if self._n > 0 and self._prior_y > 0 else 1.0
        prior = [b * scale for b in self.PRIOR]
        # ridge toward the prior on each term's relative change: a term doubled costs as much as
        # a hundredth of an observation off by the mean step time; so a term the steps cannot
        # see (the attention at short contexts: its share of their time is tiny) keeps its
        # prior, and one they show moves freely
        mean = self._y / self._n if self._n > 0 else 1.0
        a = [row[:] for row in self._xx]
        rhs = self._xy[:]
        for j in range(k):
            lam = self.PRIOR_WEIGHT * (mean / prior[j]) ** 2
            a[j][j] += lam
            rhs[j] += lam * prior[j]
        beta = _solve(a, rhs)
        if beta is None or any(b < 0 for b in beta):  # a poor fit: the prior's shape, scaled
            return tuple(prior)
        return tuple(beta)

    def guess_share(self, step: StepShape, context: int) -> float:
        """The chance a guess must have of being kept to pay for its row: the row's cost (its
        matmuls and its attention over `context` positions) as a share of the step's time per
        row it already has (`step`: its decode rows)."""
        fixed, per_row, per_position, per_read = self.coefficients()
        rows = max(1, step.rows)
        time = fixed + per_row * rows + per_position * step.positions + per_read * step.read
        guess = per_row + per_position * context
        return min(1.0, rows * guess / time) if time > 0 else 1.0


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (None: singular)."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


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
