"""Draft-model speculation (`--draft-model PATH`): guesses from a smaller model with the same
vocabulary, run greedily ahead of the request.

The draft runs on an engine of its own (its weights, its paged KV cache, its model thread), one
session per guessing request holding what the request's context was at the last guess plus
the guesses. Each guess syncs that session to the request's tokens (the draft keeps the longest
common prefix and computes only what is new), then decodes the guesses greedily. Verification
is the target's, as for prompt lookup (engine/speculation.py): the guesses are point-mass
drafts, so greedy output and logprobs are the same with and without them, and sampling keeps the
target's distribution. How many to guess adapts as for prompt lookup: while a first guess is
seldom kept, one now and then.

The target's model thread waits while the draft runs: the two never compete for the cores.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent
from tokenwire.engine.session import common_prefix
from tokenwire.engine.speculation import Speculator

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0)


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """A draft's guesses are token ids of the target's: both vocabularies must be one. Refused at
    start, naming the first id that differs."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"--draft-model {draft_name} has a vocabulary of {draft.vocab_size} tokens, the model "
            f"{target.vocab_size}: a draft must share the model's tokenizer"
        )
    for token in range(target.vocab_size):
        if target.token_bytes(token) != draft.token_bytes(token):
            raise ValueError(
                f"--draft-model {draft_name}'s token {token} is {draft.token_bytes(token)!r}, the "
                f"model's {target.token_bytes(token)!r}: a draft must share the model's tokenizer"
            )


class DraftSpeculator(Speculator):
    """One request's guesses from the draft engine (a session there, closed with the request)."""

    def __init__(self, draft: EngineAPI) -> None:
        super().__init__()
        self.draft = draft
        self._session: str | None = None
        self._held: list[int] = []  # the draft session's tokens

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        count = self.to_guess(limit, threshold)
        if count == 0:
            return []
        if len(tokens) + count > self.draft.max_model_len:
            return []  # past the draft's context: no guesses
        # the last token is fed again whatever is kept: its logits give the first guess
        common = min(common_prefix(self._held, tokens), len(tokens) - 1)
        opts = GenerateOptions(max_tokens=count, sampling=_GREEDY, ignore_eos=True, speculate=False)
        try:
            if self._session is None:
                self._session = self.draft.create_session(ttl_s=None)
            self.draft.truncate_session(self._session, common)
            events, _ = self.draft.generate(self._session, tokens[common:], opts).result()
        except EngineError as e:  # guesses are optional: a draft shutting down or full gives none
            log.debug("no draft guesses: %s", e)
            self._held = []
            return []
        guesses = [e.token_id for e in events if isinstance(e, TokenEvent) and not e.is_prefill]
        self._held = [*tokens, *guesses]
        return guesses

    def close(self) -> None:
        if self._session is not None:
            self.draft.close_session(self._session)
            self._session = None
