"""Structured output (regex / JSON schema / Lark grammar) as a :class:`Constraint`, via llguidance.

Per sampling point :meth:`GrammarConstraint.next_step` returns, in this order of precedence:

* ``stop=True`` when the grammar is complete and cannot be extended (llguidance's matcher is
  *stopped*: only EOS would be allowed), or when the mask allows nothing but EOS tokens.
  The engine then finishes the sequence without sampling EOS.
* ``force=[...]`` when the grammar admits exactly one continuation for the next bytes
  (llguidance's fast-forward tokens, e.g. a literal prefix ``"The answer is: "``).
* otherwise ``allowed`` = bool mask of width ``vocab_size``. EOS ids are allowed iff the grammar
  is currently in an accepting state (so the model may end the output there); padding ids
  (``>=`` the tokenizer's vocab) are never allowed.

The constraint only covers the generated part: prompt tokens given to :meth:`start` are ignored.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch

from tokenwire.engine import grammar_guard
from tokenwire.engine.constraints import Constraint, ConstraintError, ConstraintStep
from tokenwire.engine.grammar_guard import GrammarTooLarge

__all__ = ["ConstraintError", "GrammarConstraint", "GrammarTooLarge", "lltokenizer_for"]

_CACHE_LOCK = threading.Lock()
# key: (id(hf_tokenizer), eos override) -> (hf_tokenizer kept alive so its id is not reused, compiled)
_TOKENIZER_CACHE: dict[tuple[int, tuple[int, ...] | None], tuple[Any, llguidance.LLTokenizer]] = {}

TokenizerLike = Any  # a fast HF tokenizer, or an already built llguidance.LLTokenizer


def _eos_key(eos_token_ids: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if eos_token_ids is None:
        return None
    if isinstance(eos_token_ids, int):
        return (eos_token_ids,)
    return tuple(int(t) for t in eos_token_ids)


def lltokenizer_for(
    tokenizer: TokenizerLike, eos_token_ids: int | Sequence[int] | None = None
) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for an HF fast tokenizer, compiled once (~0.5 s) and cached.

    ``eos_token_ids`` overrides the tokenizer's EOS id(s) (the ids the grammar allows at its end).
    An ``llguidance.LLTokenizer`` is returned as is (``eos_token_ids`` must then be None).
    """
    if isinstance(tokenizer, llguidance.LLTokenizer):
        if eos_token_ids is not None:
            raise ValueError("eos_token_ids cannot be overridden for a prebuilt LLTokenizer")
        return tokenizer
    eos = _eos_key(eos_token_ids)
    key = (id(tokenizer), eos)
    with _CACHE_LOCK:
        hit = _TOKENIZER_CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        llt = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos) if eos is not None else None)
        _TOKENIZER_CACHE[key] = (tokenizer, llt)
        return llt


# The lexer work one step of one constrained request may do, on the engine thread that every
# request's step shares. llguidance's defaults (200,000 fuel, 250,000 lexer states) let issue 29's
# regex `(a|aa)*`x50 + `b{1000000}` spend 20-45 ms a token and 160 ms on the token where it gives
# up; at 50,000 each, that worst step is 44 ms, while a JSON schema with patterns, anyOf and
# arrays and an e-mail regex take the same time per step as with the defaults (80 steps each,
# this machine). Over the limit, the request ends as the client's bad grammar (400).
STEP_LEXER_FUEL = 50_000
MAX_LEXER_STATES = 50_000


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        verbose_errors=False, step_lexer_fuel=STEP_LEXER_FUEL, max_lexer_states=MAX_LEXER_STATES
    )


class GrammarConstraint(Constraint):
    """A :class:`Constraint` backed by an ``llguidance.LLMatcher``.

    Build with :meth:`regex`, :meth:`json_schema` or :meth:`lark`; or pass an llguidance grammar
    string (``llguidance.grammar_from(...)``) to the constructor directly.

    Every grammar is measured against engine/grammar_guard's limits before it is compiled
    (GrammarTooLarge, a ValueError naming the limit's flag) and compiled on a thread whose stack
    a deep chain of rules cannot overflow.

    Raises ``ValueError`` (llguidance's message) for an invalid grammar, and
    :class:`ConstraintError` when a token the grammar does not allow is appended, when a
    backtrack goes past the generated tokens, or when the matcher fails mid-generation.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        vocab_size: int,
        grammar: str,
        *,
        eos_token_ids: int | Sequence[int] | None = None,
        limits: llguidance.LLParserLimits | None = None,
        measured: bool = False,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if not measured:  # the factories measure the user's own text, with its kind's name
            grammar_guard.check("grammar", grammar_guard.measure_llguidance(grammar))
        self._llt = lltokenizer_for(tokenizer, eos_token_ids)
        if limits is None:
            limits = parser_limits()
        matcher = _on_deep_stack(lambda: llguidance.LLMatcher(self._llt, grammar, log_level=0, limits=limits))
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {_clean(matcher.get_error())}")
        self._matcher = matcher
        # what it was built from: a replica process rebuilds it from these (serve --replicas)
        self.grammar, self.eos_token_ids = grammar, eos_token_ids
        self._init_state(vocab_size)

    def _init_state(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._n_tok: int = self._llt.vocab_size
        self._eos: frozenset[int] = frozenset(self._llt.eos_tokens)
        self._buf = llguidance.numpy.allocate_token_bitmask(1, self._n_tok)
        # one entry per token appended after start(): False when llguidance did not record it
        # (EOS consumed by an already-stopped matcher is a no-op there and must not be rolled back)
        self._recorded: list[bool] = []

    # ---- factories -------------------------------------------------------------------------------

    @classmethod
    def regex(cls, tokenizer: TokenizerLike, vocab_size: int, pattern: str, **kw: Any) -> GrammarConstraint:
        """Output must fully match ``pattern`` (Rust ``regex`` crate syntax, anchored both ends)."""
        grammar_guard.check("regex", grammar_guard.measure_regex(pattern))
        return cls._compiled(
            tokenizer, vocab_size, lambda: llguidance.LLMatcher.grammar_from_regex(pattern), kw
        )

    @classmethod
    def json_schema(
        cls,
        tokenizer: TokenizerLike,
        vocab_size: int,
        schema: dict[str, Any] | str,
        *,
        options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> GrammarConstraint:
        """Output must be JSON valid against ``schema``.

        ``options``: llguidance JSON compile options applied as overrides, e.g.
        ``{"whitespace_flexible": False}`` for compact output (llguidance's default is flexible
        whitespace) or ``{"item_separator": ", ", "key_separator": ": "}``.
        """
        text_bytes = None
        if isinstance(schema, str):  # llguidance splices strings in verbatim; errors would be confusing
            grammar_guard.check(
                "JSON schema", grammar_guard.Measure(bytes=len(schema.encode("utf-8", "replace")))
            )
            text_bytes = len(schema.encode("utf-8", "replace"))
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"invalid JSON schema: not valid JSON: {e}") from e
        grammar_guard.check("JSON schema", grammar_guard.measure_json_schema(schema, text_bytes))

        def convert() -> str:
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
            except (ValueError, TypeError) as e:
                raise ValueError(f"invalid JSON schema: {e}") from e

        return cls._compiled(tokenizer, vocab_size, convert, kw)

    @classmethod
    def lark(cls, tokenizer: TokenizerLike, vocab_size: int, grammar: str, **kw: Any) -> GrammarConstraint:
        """Output must match the Lark grammar (llguidance's Lark dialect; start rule ``start``)."""
        grammar_guard.check("Lark grammar", grammar_guard.measure_lark(grammar))
        return cls._compiled(
            tokenizer, vocab_size, lambda: llguidance.LLMatcher.grammar_from_lark(grammar), kw
        )

    @classmethod
    def _compiled(
        cls, tokenizer: TokenizerLike, vocab_size: int, convert: Callable[[], str], kw: dict[str, Any]
    ) -> GrammarConstraint:
        """The user's grammar (already measured) converted and compiled in one deep-stack call."""
        return _on_deep_stack(lambda: cls(tokenizer, vocab_size, convert(), measured=True, **kw))

    # ---- Constraint ------------------------------------------------------------------------------

    def next_step(self) -> ConstraintStep:
        m = self._matcher
        self._check("matcher failed")
        if m.is_stopped():
            return ConstraintStep(stop=True)
        ff = m.compute_ff_tokens()
        self._check("computing forced tokens failed")
        if ff:
            return ConstraintStep(force=list(ff))
        allowed = self.compute_mask()
        if m.is_stopped():
            return ConstraintStep(stop=True)
        bits = allowed.numpy()
        n_eos = sum(int(bits[t]) for t in self._eos if t < self.vocab_size)
        if np.count_nonzero(bits) == n_eos:  # nothing but EOS (or nothing at all) is possible
            return ConstraintStep(stop=True)
        return ConstraintStep(allowed=allowed)

    def compute_mask(self) -> torch.Tensor:
        """Bool mask [vocab_size] of the tokens allowed now (EOS included iff accepting)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._buf)
        self._check("computing the token mask failed")
        n = min(self._n_tok, self.vocab_size)
        words = self._buf[0].astype("<u4", copy=False)  # bit i of word w = token 32*w + i
        bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=n)
        if self.vocab_size > n:  # logits wider than the tokenizer: padding ids never allowed
            bits = np.concatenate([bits, np.zeros(self.vocab_size - n, dtype=np.uint8)])
        return torch.from_numpy(bits).view(torch.bool)

    def on_token(self, token: int) -> None:
        m = self._matcher
        if not 0 <= token < self._n_tok:
            raise ConstraintError(f"token id {token} is outside the tokenizer's vocabulary ({self._n_tok})")
        was_stopped = m.is_stopped()
        if not m.consume_token(token):
            raise ConstraintError(
                f"grammar rejected token {token} {self._llt.dbg_tokens([token])}: {_clean(m.get_error())}"
            )
        self._recorded.append(not (was_stopped and token in self._eos))

    def speculation(self, guesses: list[int], limit: int) -> tuple[int, list[int]]:
        """The guesses the grammar allows from here, then the span it forces after them (a
        JSON schema's next key, a regex's literal): the forced span runs in the same forward
        as the tokens before it instead of a step of its own."""
        m = self._matcher
        if m.is_stopped() or m.is_error():
            return 0, []
        allowed = m.validate_tokens(guesses[:limit]) if guesses else 0
        if allowed == 0:
            return 0, list(m.compute_ff_tokens())[:limit]
        ahead = m.deep_copy()  # the state after the guesses, without touching this one's
        if not ahead.consume_tokens(guesses[:allowed]):
            return allowed, []
        return allowed, list(ahead.compute_ff_tokens())[: limit - allowed]

    def on_backtrack(self, n: int) -> None:
        if n < 0 or n > len(self._recorded):
            raise ConstraintError(f"cannot backtrack {n} tokens: only {len(self._recorded)} were generated")
        if n == 0:
            return
        k = sum(self._recorded[-n:])
        del self._recorded[-n:]
        if k and not self._matcher.rollback(k):
            err = _clean(self._matcher.get_error())
            raise ConstraintError(f"grammar rollback of {k} tokens failed: {err}")

    def fork(self) -> GrammarConstraint:
        """An independent copy in the same state (AICI's declarative controller clones a
        generation's grammar with it when a sequence forks)."""
        other = object.__new__(GrammarConstraint)
        other._llt = self._llt
        other._matcher = self._matcher.deep_copy()
        other._init_state(self.vocab_size)
        other._recorded = list(self._recorded)
        return other

    # ---- introspection ---------------------------------------------------------------------------

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The underlying matcher, for batched mask computation (llguidance.LLExecutor); read
        its state only: feed tokens through on_token/on_backtrack."""
        return self._matcher

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (ending here would be valid)."""
        return self._matcher.is_accepting()

    @property
    def stop_reason(self) -> str:
        """llguidance's stop reason ("NotStopped", "NoExtension", "EndOfSentence", ...)."""
        return str(self._matcher.stop_reason())

    @property
    def warnings(self) -> list[str]:
        """llguidance's warnings about the grammar (e.g. ignored JSON schema keywords)."""
        return list(self._matcher.get_grammar_warnings())

    def _check(self, what: str) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"{what}: {_clean(self._matcher.get_error())}")


_DEEP = threading.local()


def _on_deep_stack(fn: Callable[[], Any]) -> Any:
    """fn() on a grammar-compile thread (grammar_guard.compile_deep), or here when already on one."""
    if getattr(_DEEP, "inside", False):
        return fn()

    def marked() -> Any:
        _DEEP.inside = True
        return fn()

    return grammar_guard.compile_deep(marked)


def _clean(msg: str) -> str:
    return msg.replace("<non-verbose/>", "").strip()


_FLAGS = {"regex": "--regex", "json_schema": "--json-schema", "lark": "--lark"}


def check_grammar(kind: str, source: str) -> None:
    """ValueError naming the flag and what is wrong with a regex, JSON schema or Lark grammar,
    checked without a tokenizer (so before any model loads). llguidance's message echoes its
    internal grammar (`start: /(/`); only the user's part is kept."""
    flag = _FLAGS[kind]
    try:
        if kind == "regex":
            grammar_guard.check(flag, grammar_guard.measure_regex(source))
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        elif kind == "json_schema":
            schema = json.loads(source)
            grammar_guard.check(flag, grammar_guard.measure_json_schema(schema, len(source.encode())))
            grammar = _on_deep_stack(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema))
        else:
            grammar_guard.check(flag, grammar_guard.measure_lark(source))
            grammar = llguidance.LLMatcher.grammar_from_lark(source)
    except GrammarTooLarge:
        raise
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{flag}: not valid JSON: {e}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag}: {e}") from None
    error = _on_deep_stack(lambda: llguidance.LLMatcher.validate_grammar(grammar, None))
    if error:
        raise ValueError(f"invalid {flag} {source!r}: {_user_part(_clean(error))}")


def _user_part(message: str) -> str:
    """The reason in an llguidance error: its `error: ...` line, else the first line without
    the position prefix and without the echoed grammar."""
    lines = [line.strip() for line in message.splitlines()]
    for line in lines:
        if line.startswith("error:"):
            return line[len("error:") :].strip()
    first = re.sub(r"^at \d+\(\d+\):\s*", "", lines[0]) if lines else message
    return first.split(" (in regex)")[0].rstrip(":")
