"""The host functions jsctrl's glue calls (tokenizer, variables, llguidance constraints, logs).

Every function is registered with QuickJS and therefore must never raise: a Python exception
inside a QuickJS callback leaves the binding in an error state. Failures are returned as a
string starting with ERR, which the glue turns into a JavaScript Error.

Values cross the boundary as primitives only (the binding cannot pass lists or bytes): token
lists and strings as JSON text, bytes as hex, token masks as the hex of 32-bit words.

Determinism for clone-by-replay: the only inputs a program can read that do not come from the
callbacks' arguments are the shared variables. `get_var` results are journaled while running
live and served back from the journal while replaying; writes and logs are suppressed in replay.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from tokenwire.protocols.aici.controller import TokenizerEnv, VariableStore

ERR = "\u0001ERR:"
MASKS_KEPT = 8  # host-side masks a TokenSet may still refer to
MAX_CONSTRAINTS = 4096  # live host constraints per controller (each holds an llguidance matcher)
# CPU seconds tokenizing costs per input character (measured 0.96 us with SmolLM2's tokenizer on
# the 2-core development VM): a call that cannot finish in the callback's time left is refused
# before it starts (tokenize("ab ".repeat(5e6)) took 18.5 s of CPU against a 1 s budget)
TOKENIZE_S_PER_CHAR = 1e-6


class ReplayDiverged(RuntimeError):
    """A replayed program read a different variable than the original run did."""


class GrammarMatcher:
    """One llguidance matcher seen through jsctrl's Constraint interface."""

    def __init__(self, env: TokenizerEnv, grammar: str) -> None:
        if env.ll_tokenizer is None:
            raise ValueError(
                "this tokenizer has no llguidance tokenizer: grammar constraints are unavailable"
            )
        self.llt = env.ll_tokenizer
        self.m = llguidance.LLMatcher(self.llt, grammar, log_level=0)
        if self.m.is_error():
            raise ValueError(_clean(self.m.get_error()))
        self.words = (env.vocab_size + 31) // 32
        self.buf = llguidance.numpy.allocate_token_bitmask(1, self.llt.vocab_size)

    def eos_allowed(self) -> bool:
        return bool(self.m.is_accepting())

    def eos_forced(self) -> bool:
        return bool(self.m.is_stopped())

    def token_allowed(self, t: int) -> bool:
        return bool(self.m.validate_tokens([t]) == 1)

    def append(self, t: int) -> None:
        if not self.m.consume_token(t):
            raise ValueError(f"token {t} is not allowed here: {_clean(self.m.get_error())}")

    def mask_words(self) -> np.ndarray:
        """The allowed tokens as uint32 words (bit i of word w = token 32w+i), vocab-wide."""
        llguidance.numpy.fill_next_token_bitmask(self.m, self.buf)
        if self.m.is_error():
            raise ValueError(_clean(self.m.get_error()))
        words = np.zeros(self.words, dtype=np.uint32)
        n = min(self.words, self.buf.shape[1])
        words[:n] = self.buf[0, :n].view(np.uint32)
        return words


def _clean(msg: str) -> str:
    return msg.replace("<non-verbose/>", "").strip()


class JsHost:
    """Host state of one JsController: the functions its QuickJS context may call."""

    def __init__(
        self,
        env: TokenizerEnv,
        variables: VariableStore,
        emit_log: Callable[[str], None],
        emit_storage: Callable[[dict[str, Any]], None],
        seed: int,
        max_input: int = 2**20,
    ) -> None:
        self.env = env
        self.variables = variables
        self.emit_log = emit_log
        self.emit_storage = emit_storage
        self.seed = seed
        self.constraints: dict[int, GrammarMatcher] = {}
        self.grammar_sizes: dict[int, int] = {}  # characters of each live constraint's grammar
        self.next_handle = 1
        self.masks: dict[int, np.ndarray] = {}  # recent masks by id (TokenSets refer to them)
        self.next_mask = 1
        self.var_reads: list[tuple[str, str | None]] = []  # journal of get_var results
        self.replay_reads: list[tuple[str, str | None]] | None = None  # set while replaying
        self.max_input = max_input  # characters of text or grammar one call takes
        self.deadline = float("inf")  # time.thread_time() at which the running callback ends

    def _check_input(self, what: str, text: str, per_char_s: float = 0.0) -> None:
        """Refuse work the callback cannot afford before doing any of it (size, time left)."""
        if len(text) > self.max_input:
            raise ValueError(
                f"{what} of {len(text)} characters, the limit is {self.max_input} (--max-host-input-kb)"
            )
        left = self.deadline - time.thread_time()
        if len(text) * per_char_s > left:
            raise ValueError(
                f"{what} of {len(text)} characters needs more time than the callback has left "
                f"({max(left, 0.0) * 1e3:.1f} ms)"
            )

    # ---- registration -----------------------------------------------------------------------------

    def functions(self) -> dict[str, Callable[..., Any]]:
        names = [
            "vocab_size", "seed", "eos", "tokenize", "tokenize_bytes", "detokenize", "tokens_repr",
            "utf8_encode", "utf8_decode", "buffer_repr", "get_var", "set_var", "log",
            "c_regex", "c_lark", "c_substr", "c_eos_allowed", "c_eos_forced", "c_token_allowed",
            "c_append", "c_mask", "c_free", "mask_hex", "mask_count",
        ]  # fmt: skip
        return {n: _safe(getattr(self, "h_" + n)) for n in names}

    # ---- tokenizer --------------------------------------------------------------------------------

    def h_vocab_size(self) -> int:
        return self.env.vocab_size

    def h_seed(self) -> int:
        return self.seed

    def h_eos(self) -> int:
        return self.env.eos_token_id

    def h_tokenize(self, text_json: str) -> str:
        self._check_input("tokenize", text_json, TOKENIZE_S_PER_CHAR)
        return json.dumps(self.env.tokenize(json.loads(text_json)))

    def h_tokenize_bytes(self, hex_bytes: str) -> str:
        self._check_input("tokenize", hex_bytes, TOKENIZE_S_PER_CHAR / 2)
        return json.dumps(self.env.tokenize(bytes.fromhex(hex_bytes).decode("utf-8", "replace")))

    def h_detokenize(self, tokens_json: str) -> str:
        self._check_input("detokenize", tokens_json)
        return self.env.detokenize(self._tokens(tokens_json)).hex()

    def h_tokens_repr(self, tokens_json: str) -> str:
        self._check_input("tokensRepr", tokens_json)
        table = self.env.token_bytes
        parts = [repr(table[t])[1:] if 0 <= t < len(table) else f"<{t}>" for t in self._tokens(tokens_json)]
        return ", ".join(parts) if len(parts) != 1 else parts[0]

    def _tokens(self, tokens_json: str) -> list[int]:
        tokens = json.loads(tokens_json)
        for t in tokens:
            if not isinstance(t, int) or not 0 <= t < self.env.vocab_size:
                raise ValueError(f"invalid token id {t!r}")
        return tokens

    # ---- strings and bytes -------------------------------------------------------------------------

    def h_utf8_encode(self, text_json: str) -> str:
        self._check_input("toBuffer", text_json)
        return json.loads(text_json).encode("utf-8", "surrogatepass").hex()

    def h_utf8_decode(self, hex_bytes: str) -> str:
        self._check_input("fromBuffer", hex_bytes[: len(hex_bytes) // 2])
        return json.dumps(bytes.fromhex(hex_bytes).decode("utf-8", "replace"))

    def h_buffer_repr(self, hex_bytes: str) -> str:
        self._check_input("a buffer", hex_bytes[: len(hex_bytes) // 2])
        data = bytes.fromhex(hex_bytes)
        try:
            return "b" + json.dumps(data.decode("utf-8"), ensure_ascii=False)
        except UnicodeDecodeError:
            return repr(data)

    # ---- variables and logs ------------------------------------------------------------------------

    def h_get_var(self, name: str) -> str | None:
        if self.replay_reads is not None:
            if not self.replay_reads or self.replay_reads[0][0] != name:
                raise ReplayDiverged(f"replay read variable {name!r} out of order")
            _, value = self.replay_reads.pop(0)
        else:
            raw = self.variables.get(name)
            value = None if raw is None else raw.hex()
        self.var_reads.append((name, value))
        return value

    def h_set_var(self, name: str, hex_value: str, append: bool) -> None:
        if self.replay_reads is None:  # the original run already wrote it
            self.emit_storage(self.variables.set(name, bytes.fromhex(hex_value), append=bool(append)))

    def h_log(self, text: str) -> None:
        if self.replay_reads is None:
            self.emit_log(text + "\n")

    # ---- constraints -------------------------------------------------------------------------------

    def _add(self, grammar: str) -> int:
        self._check_input("a grammar", grammar)
        if len(self.constraints) >= MAX_CONSTRAINTS:
            raise ValueError(f"too many live constraints (limit {MAX_CONSTRAINTS})")
        # live matchers grow with their grammars: all of them together get 4 single inputs' worth
        live = sum(self.grammar_sizes.values()) + len(grammar)
        if live > 4 * self.max_input:
            raise ValueError(
                f"live constraints' grammars of {live} characters, the limit is {4 * self.max_input} "
                "(4 x --max-host-input-kb)"
            )
        h = self.next_handle
        self.next_handle += 1
        self.constraints[h] = GrammarMatcher(self.env, grammar)
        self.grammar_sizes[h] = len(grammar)
        return h

    def _get(self, h: int) -> GrammarMatcher:
        c = self.constraints.get(h)
        if c is None:
            raise ValueError(f"constraint {h} was freed")
        return c

    def h_c_regex(self, pattern: str) -> int:
        self._check_input("a regex", pattern)
        return self._add(llguidance.LLMatcher.grammar_from_regex(pattern))

    def h_c_lark(self, grammar: str) -> int:
        return self._add(llguidance.LLMatcher.grammar_from_lark(grammar))

    def h_c_substr(self, template: str, stop_at: str) -> int:
        self._check_input("a substring template", template + stop_at)
        # llguidance's substring lexeme: any run of whole words of `template`, then `stop_at`
        lark = f"start: SUB {json.dumps(stop_at)}\nSUB: %regex {json.dumps({'substring_words': template})}"
        if not stop_at:
            lark = f"start: SUB\nSUB: %regex {json.dumps({'substring_words': template})}"
        return self._add(llguidance.LLMatcher.grammar_from_lark(lark))

    def h_c_eos_allowed(self, h: int) -> bool:
        return self._get(h).eos_allowed()

    def h_c_eos_forced(self, h: int) -> bool:
        return self._get(h).eos_forced()

    def h_c_token_allowed(self, h: int, t: int) -> bool:
        return self._get(h).token_allowed(t)

    def h_c_append(self, h: int, t: int) -> None:
        self._get(h).append(t)

    def h_c_mask(self, h: int) -> int:
        mask_id = self.next_mask
        self.next_mask += 1
        self.masks[mask_id] = self._get(h).mask_words()
        for old in [k for k in self.masks if k <= mask_id - MASKS_KEPT]:
            del self.masks[old]
        return mask_id

    def mask(self, mask_id: int) -> np.ndarray:
        words = self.masks.get(mask_id)
        if words is None:
            raise ValueError(f"token mask {mask_id} is no longer available (keep at most {MASKS_KEPT})")
        return words

    def h_mask_hex(self, mask_id: int) -> str:
        return self.mask(mask_id).astype(">u4").tobytes().hex()

    def h_mask_count(self, mask_id: int) -> int:
        return int(np.unpackbits(self.mask(mask_id).view(np.uint8)).sum())

    def h_c_free(self, h: int) -> None:
        self.constraints.pop(h, None)
        self.grammar_sizes.pop(h, None)


def _safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            return f"{ERR}{type(e).__name__}: {e}"

    call.__name__ = fn.__name__
    return call
