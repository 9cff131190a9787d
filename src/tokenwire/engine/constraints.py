"""Per-sequence constraint hook used by the sampler.

A :class:`Constraint` is attached to one sequence and consulted at every sampling point.
The engine's protocol for one sampling point is::

    while True:
        step = c.next_step()
        if step.stop:            # finish the sequence now, finish reason "stop"
            break
        if step.backtrack:       # drop tokens, tell the constraint, recompute, ask again
            drop(step.backtrack); c.on_backtrack(step.backtrack); continue
        if step.force:           # append without sampling, on_token() for each, compute, ask again
            for t in step.force: append(t); c.on_token(t)
            continue
        logits = processed_logits(logits, step)   # sampler.py: bias, then -inf on disallowed ids
        tok = sample(logits); append(tok); c.on_token(tok)
        break

(postprocess.py runs it, one step per model step.) Structured output
(:mod:`tokenwire.engine.grammar`) and the AICI controller runtime both implement this
interface. A constraint belongs to one request: forking a session forks no constraint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

__all__ = ["Constraint", "ConstraintError", "ConstraintStep"]


class ConstraintError(RuntimeError):
    """A constraint can no longer make progress (e.g. a token it did not allow was appended)."""


@dataclass
class ConstraintStep:
    """What a constraint wants at one sampling point.

    Fields are consulted in the order ``stop`` > ``backtrack`` > ``force`` > (``bias``, ``allowed``).
    """

    allowed: torch.Tensor | None = None  # bool [vocab_size] (True = may be sampled); None = no mask
    bias: torch.Tensor | None = None  # float32 [vocab_size] added to the logits
    force: list[int] = field(default_factory=list)  # tokens to append without sampling (fast-forward)
    backtrack: int = 0  # drop this many of the sequence's most recent tokens first
    stop: bool = False  # finish the sequence now (finish reason "stop")


class Constraint(ABC):
    """Per-sequence hook consulted before each sampling step.

    Lifecycle: ``start(prompt_tokens)`` once, then repeatedly ``next_step()`` followed by
    ``on_token`` (for each sampled or forced token, in order) or ``on_backtrack``.
    """

    def start(self, tokens: list[int]) -> None:  # noqa: B027 - optional hook, default no-op
        """Called once with the sequence's full token list before the first generated token."""

    @abstractmethod
    def next_step(self) -> ConstraintStep:
        """Called before each sampling step."""

    @abstractmethod
    def on_token(self, token: int) -> None:
        """Called for every token appended after :meth:`start`, sampled or forced, in order."""

    def speculation(self, guesses: list[int], limit: int) -> tuple[int, list[int]]:
        """For a step that runs guesses of the next tokens (engine/speculation.py): how many of
        `guesses` to run, and the tokens this constraint would force after them, run as further
        guesses (kept where it does force them); at most `limit` tokens in all. By default every
        guess runs and verification asks next_step() at each row; a constraint that can look
        ahead cuts the guesses it would refuse, so they are never proposed."""
        return min(len(guesses), limit), []

    def on_backtrack(self, n: int) -> None:
        """The engine dropped the ``n`` most recent tokens (after this constraint asked for it).

        Constraints that ever return ``backtrack > 0`` must override this.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support backtracking")
