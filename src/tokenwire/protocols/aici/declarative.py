"""Declarative controllers on llguidance (built-in tags `llguidance`, `declctrl`, `regex`,
`json_schema`, `lark`).

The module_arg (JSON text or object) is a small program, run one step after another:

    {"steps": [
        {"fixed": "The answer: "},                  # fast-forwarded (pre_process ff_tokens)
        {"gen": {"regex": "\\d\\d", "max_tokens": 4, "store_var": "answer"}},
        {"fixed": " (final)", "backtrack": 1},      # mid_process splice: drop 1 token, then these
        {"fork": [[{"fixed": " A"}], [{"fixed": " B"}]]}   # num_forks = 2, one branch per fork
    ]}

Shortcuts: {"regex": ...}, {"json_schema": ...}, {"lark": ...} (one gen step), and for the
`llguidance` tag an llguidance grammar object ({"grammars": [...]}) as AICI's llguidance
controller takes. A `gen` accepts "regex", "json_schema", "lark" or "grammar" (llguidance).

Whenever a grammar forces a unique continuation, pre_process returns it as ff_tokens instead of
sampling it token by token. EOS ends a gen only in the last step; once the program is done,
mid_process allows only EOS and the next post_process says stop.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.protocols.aici.controller import (
    Controller,
    ControllerError,
    ControllerLimits,
    MidResult,
    PostResult,
    PreResult,
    TokenizerEnv,
    VariableStore,
)

__all__ = ["DeclarativeController", "parse_program"]

_GEN_KEYS = ("regex", "json_schema", "lark", "grammar")
_GO_ON = PostResult(stop=False)  # shared: the runtime only reads results


def parse_program(arg: str | dict[str, Any], *, llguidance_tag: bool = False) -> list[dict[str, Any]]:
    """Normalize a module_arg into a list of steps; ControllerError names what is wrong."""
    if isinstance(arg, str):
        try:
            arg = json.loads(arg)
        except json.JSONDecodeError as e:
            raise ControllerError(f"module_arg is not valid JSON: {e}") from e
    if not isinstance(arg, dict):
        raise ControllerError("module_arg must be a JSON object")
    if llguidance_tag and "grammars" in arg:
        return [_check_step({"gen": {"grammar": arg}})]
    if "steps" in arg:
        steps = arg["steps"]
        if not isinstance(steps, list) or not steps:
            raise ControllerError("'steps' must be a non-empty list")
        return [_check_step(s) for s in steps]
    for key in _GEN_KEYS:
        if key in arg:
            gen = {k: v for k, v in arg.items() if k in (*_GEN_KEYS, "max_tokens", "store_var")}
            return [_check_step({"gen": gen})]
    raise ControllerError("module_arg needs 'steps', 'regex', 'json_schema', 'lark' or 'grammars'")


def _check_step(step: Any) -> dict[str, Any]:
    if not isinstance(step, dict):
        raise ControllerError(f"a step must be an object, got {step!r}")
    if "fixed" in step:
        if not isinstance(step["fixed"], str) or not isinstance(step.get("backtrack", 0), int):
            raise ControllerError("'fixed' takes a string (and an integer 'backtrack')")
        return step
    if "gen" in step:
        gen = step["gen"]
        if not isinstance(gen, dict) or sum(k in gen for k in _GEN_KEYS) != 1:
            raise ControllerError(f"'gen' needs exactly one of {', '.join(_GEN_KEYS)}")
        return step
    if "fork" in step:
        branches = step["fork"]
        if not isinstance(branches, list) or len(branches) < 2:
            raise ControllerError("'fork' takes a list of at least two branches (lists of steps)")
        return {"fork": [[_check_step(s) for s in b] for b in branches]}
    raise ControllerError(f"unknown step {step!r}: use fixed, gen or fork")


class DeclarativeController(Controller):
    def __init__(
        self,
        env: TokenizerEnv,
        variables: VariableStore,
        limits: ControllerLimits,
        arg: str | dict[str, Any],
        *,
        llguidance_tag: bool = False,
    ) -> None:
        super().__init__(env, variables, limits)
        self.steps = parse_program(arg, llguidance_tag=llguidance_tag)
        self.idx = 0
        self.gen: GrammarConstraint | None = None
        self.gen_tokens: list[int] = []
        self.pending_splice: list[int] | None = None
        self.fork_point: tuple[int, list[list[dict[str, Any]]]] | None = None
        # id(gen spec) -> its grammar compiled at init, never advanced itself: each use starts
        # from a fork (a matcher copy, microseconds; compiling takes milliseconds). Shared with
        # clones, so a fork into N branches compiles nothing in the step that forks.
        self._templates: dict[int, GrammarConstraint] = {}
        self._eos = {env.eos_token_id, *getattr(env.ll_tokenizer, "eos_tokens", ())}
        self._new_buffers()

    @property
    def done(self) -> bool:
        return self.idx >= len(self.steps)

    # ---- callbacks -------------------------------------------------------------------------

    def init_prompt(self, prompt: list[int], deadline: float) -> list[int]:
        # compile every grammar now, fork branches included: a bad one fails instantiate
        pending = list(self.steps)
        while pending:
            step = pending.pop()
            if "gen" in step and id(step["gen"]) not in self._templates:
                self._templates[id(step["gen"])] = self._grammar(step["gen"])
            elif "fork" in step:
                for branch in step["fork"]:
                    pending.extend(branch)
        return prompt

    def pre_process(self, deadline: float) -> PreResult:
        ff: list[int] = []
        while not self.done:
            step = self.steps[self.idx]
            if "fixed" in step:
                if step.get("backtrack", 0) > 0:
                    break  # a splice: mid_process does it
                ff += self.env.tokenize(step["fixed"])
                self.log(f"FIXED {step['fixed']!r}")
                self.idx += 1
            elif "fork" in step:
                branches = step["fork"]
                self.fork_point = (self.idx, branches)
                self._enter_branch(0)
                self.log(f"FORK {len(branches)}")
                return PreResult(num_forks=len(branches), ff_tokens=ff)
            else:
                gen = self._active_gen()
                m = gen.matcher
                self._check(m)
                if m.is_stopped():
                    self._finish_gen()
                    continue
                force = m.compute_ff_tokens()
                self._check(m)
                if force:
                    for t in force:
                        gen.on_token(t)
                    self.gen_tokens += force
                    ff += force
                    if self._gen_limit_reached():
                        self._finish_gen()
                elif m.is_accepting() and self.idx < len(self.steps) - 1:
                    # the grammar may be complete: only the mask tells whether anything but EOS
                    # may follow, and if not, the next step starts now. Computed here once and
                    # handed to mid_process (same state). In the last step there is no next
                    # step: mid_process's batched mask allows EOS there, and EOS ends it.
                    words = self._mask_buf
                    llguidance.numpy.fill_next_token_bitmask(m, words)
                    self._check(m)
                    rest = words[0].view(np.uint32) & self._not_eos_words
                    if m.is_stopped() or not rest.any():
                        self._finish_gen()
                        continue
                    self._pre_mask = words[0]
                    break
                else:
                    break  # mid_process hands the matcher to the runtime's batched mask
        return PreResult(ff_tokens=ff)

    def mid_process(self, deadline: float) -> MidResult:
        if self.done:
            return MidResult(mask=self._eos_words.view(np.int32))
        step = self.steps[self.idx]
        if "fixed" in step:  # a splice, or a fork branch's first text: the engine appends it
            self.pending_splice = self.env.tokenize(step["fixed"])
            self.log(f"SPLICE {step['fixed']!r} backtrack {step.get('backtrack', 0)}")
            return MidResult(ff_tokens=list(self.pending_splice), backtrack=int(step.get("backtrack", 0)))
        if "fork" in step:
            raise ControllerError("a fork must follow a generated or fixed token, not another fork")
        # EOS would end the whole sequence, not this step
        disallow = tuple(self._eos) if self.idx < len(self.steps) - 1 else ()
        if self._pre_mask is not None:
            mask, self._pre_mask = self._pre_mask, None
            return MidResult(mask=mask, disallow=disallow)
        return MidResult(matcher=self._active_gen().matcher, disallow=disallow)

    def post_process(self, backtrack: int, tokens: list[int], deadline: float) -> PostResult:
        self._pre_mask = None
        if self.pending_splice is not None:
            if tokens != self.pending_splice:
                raise ControllerError(
                    f"splice expected tokens {self.pending_splice}, engine appended {tokens}"
                )
            self.pending_splice = None
            self.idx += 1
            return PostResult(stop=False)
        if backtrack:
            raise ControllerError(f"backtrack of {backtrack} tokens that this controller did not ask for")
        for t in tokens:
            if self.done:
                return PostResult(stop=True)
            gen = self._active_gen()
            if t in self._eos:
                self._finish_gen()
                self.idx = len(self.steps)
                return PostResult(stop=True)
            gen.on_token(t)
            self.gen_tokens.append(t)
            if gen.matcher.is_stopped() or self._gen_limit_reached():
                self._finish_gen()
        return _GO_ON

    def clone(self, fork_index: int) -> DeclarativeController:
        other = copy.copy(self)
        other.logs, other.storage = [], []
        other._templates = self._templates  # read-only: every use forks
        pre_mask = self._pre_mask
        other._new_buffers()  # own mask buffer: the parent refills its own next step
        if pre_mask is not None:
            other._mask_buf[0] = pre_mask
            other._pre_mask = other._mask_buf[0]
        other.steps = list(self.steps)
        other.gen = self.gen.fork() if self.gen is not None else None
        other.gen_tokens = list(self.gen_tokens)
        if self.fork_point is not None:
            at, branches = self.fork_point
            other.steps = [*self.steps[:at], {"fork": branches}, *self.steps[at + len(branches[0]) :]]
            other.idx = at
            other._enter_branch(fork_index)
        return other

    # ---- helpers ---------------------------------------------------------------------------

    def _enter_branch(self, index: int) -> None:
        at, branches = self.fork_point  # type: ignore[misc]
        self.steps = self.steps[:at] + branches[index] + self.steps[at + 1 :]

    def _grammar(self, gen: dict[str, Any]) -> GrammarConstraint:
        llt, vocab = self.env.ll_tokenizer, self.env.vocab_size
        try:
            if "regex" in gen:
                return GrammarConstraint.regex(llt, vocab, str(gen["regex"]))
            if "json_schema" in gen:
                return GrammarConstraint.json_schema(llt, vocab, gen["json_schema"])
            if "lark" in gen:
                return GrammarConstraint.lark(llt, vocab, str(gen["lark"]))
            grammar = gen["grammar"]
            text = grammar if isinstance(grammar, str) else json.dumps(grammar)
            return GrammarConstraint(llt, vocab, text)
        except (ValueError, TypeError) as e:
            raise ControllerError(f"bad grammar: {e}") from e

    def _active_gen(self) -> GrammarConstraint:
        if self.gen is None:
            spec = self.steps[self.idx]["gen"]
            template = self._templates.get(id(spec))
            self.gen = template.fork() if template is not None else self._grammar(spec)
            self.gen_tokens = []
            self.log(f"GEN {json.dumps({k: v for k, v in spec.items() if k != 'store_var'})[:200]}")
        return self.gen

    def _gen_limit_reached(self) -> bool:
        limit = self.steps[self.idx]["gen"].get("max_tokens")
        return isinstance(limit, int) and len(self.gen_tokens) >= limit

    def _finish_gen(self) -> None:
        spec = self.steps[self.idx]["gen"]
        text = self.env.detokenize(self.gen_tokens)
        self.log(f"GEN-DONE {text.decode('utf-8', 'replace')!r}")
        name = spec.get("store_var")
        if isinstance(name, str):
            self.add_storage(self.variables.set(name, text))
        self.gen = None
        self.gen_tokens = []
        self.idx += 1

    def _check(self, m: llguidance.LLMatcher) -> None:
        if m.is_error():
            raise ControllerError(f"grammar failed: {m.get_error()}")

    def _new_buffers(self) -> None:
        llt = self.env.ll_tokenizer
        n_words = ((llt.vocab_size if llt is not None else self.env.vocab_size) + 31) // 32
        self._mask_buf = llguidance.numpy.allocate_token_bitmask(1, 32 * n_words)
        self._pre_mask: np.ndarray | None = None  # the mask pre_process computed for mid_process
        self._eos_words = np.zeros(n_words, dtype=np.uint32)
        for t in self._eos:
            if 0 <= t < 32 * n_words:
                self._eos_words[t >> 5] |= np.uint32(1 << (t & 31))
        self._not_eos_words = ~self._eos_words
