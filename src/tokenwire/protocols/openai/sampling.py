"""OpenAI sampling fields -> the engine's GenerateOptions, one per choice.

Structured output (response_format, tools, regex, grammar) compiles to the engine's llguidance
constraint (engine/grammar.py). presence/frequency penalties are not an engine sampling option;
they go through the same per-sequence constraint hook as a logit bias that grows with each
generated token (OpenAI's definition: `- presence * [count > 0] - frequency * count`, over the
tokens generated so far), wrapped around the grammar when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenwire.engine.constraints import Constraint, ConstraintStep
from tokenwire.engine.grammar import GrammarConstraint, GrammarTooLarge
from tokenwire.engine.request import GenerateOptions, InvalidValueError, SamplingParams, choice_seed
from tokenwire.protocols.openai.errors import bad_request
from tokenwire.protocols.openai.schemas import Sampling

# llguidance's default JSON whitespace is flexible; a small model then may pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class PenaltyConstraint(Constraint):
    """presence/frequency penalties as a bias row, optionally around another constraint."""

    def __init__(self, width: int, presence: float, frequency: float, inner: Constraint | None) -> None:
        self.presence = presence
        self.frequency = frequency
        self.inner = inner
        self.counts: dict[int, int] = {}
        self.bias = torch.zeros(width, dtype=torch.float32)

    def start(self, tokens: list[int]) -> None:
        if self.inner is not None:
            self.inner.start(tokens)

    def next_step(self) -> ConstraintStep:
        step = self.inner.next_step() if self.inner is not None else ConstraintStep()
        if step.stop or step.backtrack or step.force:
            return step
        bias = self.bias if step.bias is None else self.bias + step.bias
        return ConstraintStep(allowed=step.allowed, bias=bias)

    def on_token(self, token: int) -> None:
        if self.inner is not None:
            self.inner.on_token(token)
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        if 0 <= token < len(self.bias):
            self.bias[token] = -(self.presence + self.frequency * count)


@dataclass
class Structure:
    """What the output must follow: (kind, spec, request field to blame), kind one of
    json_schema / regex / lark."""

    kind: str
    spec: Any
    param: str


def compile_structure(structure: Structure | None, tokenizer: Any, width: int) -> Constraint | None:
    """A fresh constraint (each choice needs its own matcher); bad grammars are 400s naming the field."""
    if structure is None:
        return None
    try:
        if structure.kind == "json_schema":
            return GrammarConstraint.json_schema(tokenizer, width, structure.spec, options=JSON_OPTIONS)
        if structure.kind == "regex":
            return GrammarConstraint.regex(tokenizer, width, structure.spec)
        return GrammarConstraint.lark(tokenizer, width, structure.spec)
    except GrammarTooLarge as exc:  # engine/grammar_guard: over a --grammar-max-* limit
        raise bad_request(str(exc), structure.param, code="grammar_too_large") from exc
    except ValueError as exc:  # UnicodeEncodeError too: a lone surrogate in the grammar
        raise bad_request(str(exc), structure.param) from exc


def logit_bias(req: Sampling) -> dict[int, float]:
    return {int(k): float(v) for k, v in (req.logit_bias or {}).items()}


def options_for(
    req: Sampling,
    *,
    choice: int,
    max_tokens: int,
    constraint: Constraint | None,
    width: int,
    logprobs: bool,
    top_logprobs: int,
    logprob_ranges: list[tuple[int, int]] | None,
    readout_ranges: list[tuple[int, int]],
) -> GenerateOptions:
    """One choice's options. Choice i of a seeded request samples with (seed + i) mod 2**64
    (engine/request.py's choice_seed): the choices differ from each other and the whole response
    is reproducible. The seed's range and the other numbers are checked by the engine's rules
    when the plan is admitted (core._admit)."""
    if req.presence_penalty or req.frequency_penalty:
        constraint = PenaltyConstraint(width, req.presence_penalty, req.frequency_penalty, constraint)
    try:
        seed = choice_seed(req.seed, choice)
    except InvalidValueError as exc:
        raise bad_request(str(exc), exc.field, "invalid_value") from None
    temperature = 1.0 if req.temperature is None else req.temperature
    if req.top_k == 1:
        temperature = 0.0  # only the best token survives: a plain argmax, no draw
    return GenerateOptions(
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed,
            logit_bias=logit_bias(req),
        ),
        stop=req.stops,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logprob_ranges=logprob_ranges,
        readout_ranges=readout_ranges,
        priority=5 if req.priority is None else req.priority,
        constraint=constraint,
        speculate=req.speculate,
    )


def check_one_structure(*given: tuple[str, Any]) -> None:
    named = [name for name, value in given if value]
    if len(named) > 1:
        raise bad_request(
            f"use at most one of {', '.join(named)}: each constrains the whole output", named[1]
        )
