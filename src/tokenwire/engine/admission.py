"""Whether the engine will take a request (the one admission check), and an admitted request's set-up.

`Engine.generate` runs it before touching a session, and protocols run it (through
`Engine.check`, or `check_request` with their own copy of the limits in sans-IO code) to refuse
a request early, in their own error shape, with the engine's words for what was wrong.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tokenwire.engine.errors import ContextOverflowError, InvalidTokenError, KVBudgetError, PositionError
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import GenerateOptions, Request
from tokenwire.engine.stop import StopStringMatcher
from tokenwire.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """What admission needs to know about the loaded model and its KV budget."""

    vocab_size: int
    max_model_len: int
    kv_blocks: int  # the KV budget, in blocks of kv_block_size positions
    kv_block_size: int
    has_concepts: bool = False
    kv_cache_mb: float | None = None  # only for the message


def check_tokens(ids: Iterable[object], vocab_size: int, what: str) -> None:
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidTokenError(f"{what}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")


def check_request(
    limits: Limits,
    prompt_len: int,
    append: Sequence[int],
    options: GenerateOptions,
    *,
    names: Mapping[str, str] | None = None,
    needs_room: bool = False,
) -> None:
    """Raise the EngineError that `generate` would raise for this request, or return.

    `prompt_len` is the session's length after the append. `names` renames fields in the
    messages ("append", "logprob_ranges", ...) to a protocol's own. With `needs_room`, a
    request that generates must leave at least one position free (the engine itself would end
    it at once with finish reason "length"; protocols whose clients expect an error ask this).
    """
    names = names or {}
    options.validate(names)
    check_tokens(append, limits.vocab_size, names.get("append", "append"))
    check_tokens(options.stop_token_ids, limits.vocab_size, "stop_token_ids")
    check_tokens(options.sampling.logit_bias.keys(), limits.vocab_size, "logit_bias")
    if options.readout_ranges and not limits.has_concepts:
        raise PositionError("readouts requested but no concept file is loaded (start with --concepts)")
    if prompt_len > limits.max_model_len:
        raise ContextOverflowError(
            f"context overflow: {prompt_len} tokens exceed the model's context length {limits.max_model_len}"
        )
    if needs_room and options.max_tokens > 0 and prompt_len >= limits.max_model_len:
        raise ContextOverflowError(
            f"prompt of {prompt_len} tokens leaves no room to generate: the context length is "
            f"{limits.max_model_len}"
        )
    if prompt_len == 0:
        raise InvalidTokenError("nothing to run: the session and the appended tokens are empty")
    blocks = -(-(prompt_len + 1) // limits.kv_block_size)
    if blocks > limits.kv_blocks:
        size = f" ({limits.kv_cache_mb:.0f} MiB, --kv-cache-mb)" if limits.kv_cache_mb is not None else ""
        raise KVBudgetError(
            f"KV cache budget exhausted: {prompt_len} tokens need {blocks} blocks but the budget "
            f"holds {limits.kv_blocks}{size}"
        )


def prepare(request: Request, tokenizer: Tokenizer, kv: KVCache) -> None:
    """An admitted request's working state: the session's KV from where the request's own
    positions must be computed (request.positions says where) forgotten, its sampling
    generator, decoder, stop matcher and constraint."""
    opts = request.options
    session = request.session
    session.uncompute_from(request.positions.recompute_from, kv)
    if opts.sampling.seed is not None:
        request.generator = torch.Generator().manual_seed(opts.sampling.seed)
    else:
        request.generator = torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:8], "little"))
    request.decoder = tokenizer.incremental_decoder(skip_special_tokens=not opts.special_text)
    if opts.stop:
        request.stopper = StopStringMatcher(list(opts.stop))
    if opts.constraint is not None:
        opts.constraint.start(list(session.tokens))
