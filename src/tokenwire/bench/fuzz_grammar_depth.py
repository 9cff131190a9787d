"""The `grammar_depth` fuzz target (issue 41): grammars whose danger is their shape, not their
text — chains of Lark rules, `$ref` chains, nested objects / arrays / anyOf, nested regex
groups, Lark brackets, llguidance's own grammar format — from a few links to 2.5x the
`--grammar-max-*` limits, through GrammarConstraint as every protocol builds one.

Before engine/grammar_guard.py, 3,000 links killed the process (SIGSEGV in llguidance's
compiler); a crash here ends the bench itself, so "0 failed" over the whole run is the claim.
Nine cases in ten are small (≤ 200 links: about a millisecond each) and one in ten is large (up
to 2.5x the limits), so 10^5 cases take minutes rather than hours while still sending ~10^4
grammars around and past each limit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenwire.bench.fuzz_targets import Target
from tokenwire.engine import grammar_guard
from tokenwire.engine.constraints import ConstraintError
from tokenwire.engine.grammar import GrammarConstraint

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

# a large case compiles up to ~20,000 rules: 0.2-0.8 s here; the margin is for a loaded machine
DEPTH_BUDGET_S = 10.0


def _size(rng: random.Random) -> int:
    if rng.random() < 0.9:
        return rng.randint(1, 200)
    limits = grammar_guard.limits()
    top = int(2.5 * max(limits.max_chain, limits.max_depth))
    return rng.randint(top // 10, top)


def _lark_chain(rng: random.Random, n: int) -> str:
    bodies = ["r{j}", '"a" r{j}', 'r{j} | "b"', "(r{j})", "r{j}?", "[r{j}]", 'r{j}+ "c"']
    body = rng.choice(bodies)
    rules = [f"r{i}: " + body.format(j=i + 1) for i in range(n)]
    return "start: r0\n" + "\n".join(rules) + f'\nr{n}: "x" | /[a-z]+/\n'


def _lark_brackets(rng: random.Random, n: int) -> str:
    open_, close = rng.choice([("(", ")"), ("[", "]"), ("(", ")*"), ("(", ")?")])
    return f'start: {open_ * n}"a"{close * n}\n'


def _wrap(rng: random.Random, inner: dict[str, Any]) -> dict[str, Any]:
    kind = rng.choice(["object", "array", "anyOf", "allOf", "additional"])  # oneOf: llguidance refuses it
    if kind == "object":
        return {"type": "object", "properties": {"k": inner}, "required": ["k"]}
    if kind == "array":
        return {"type": "array", "items": inner, "maxItems": 2}
    if kind == "additional":
        return {"type": "object", "additionalProperties": inner}
    return {kind: [inner, {"type": "null"}] if kind != "allOf" else [inner]}


def _nested_schema(rng: random.Random, n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = _wrap(rng, schema)
    return schema


def _ref_chain(rng: random.Random, n: int) -> dict[str, Any]:
    wrap = rng.random() < 0.5
    defs: dict[str, Any] = {}
    for i in range(n):
        ref: dict[str, Any] = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = _wrap(rng, ref) if wrap else ref
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _regex_groups(rng: random.Random, n: int) -> str:
    form = rng.choice(["(", "(?:", "(a|"])
    return form * n + "b" + ")" * n + rng.choice(["", "*", "+"])


def _llguidance(rng: random.Random, n: int) -> str:
    inner = _lark_chain(rng, n) if rng.random() < 0.5 else None
    entry = {"lark_grammar": inner} if inner else {"json_schema": _ref_chain(rng, n)}
    return json.dumps({"grammars": [entry]})


# (how to build the constraint, the source) per shape
_SHAPES: list[tuple[str, Callable[[random.Random, int], Any]]] = [
    ("lark", _lark_chain),
    ("lark", _lark_brackets),
    ("json_schema", _nested_schema),
    ("json_schema", _ref_chain),
    ("regex", _regex_groups),
    ("grammar", _llguidance),
]


def grammar_depth_target(engine: Engine) -> Target:
    tokenizer, vocab = engine.tokenizer.hf, engine.logits_size  # as the protocols build them

    def make(rng: random.Random) -> tuple[str, Any]:
        kind, shape = rng.choice(_SHAPES)
        return kind, shape(rng, _size(rng))

    def run(case: tuple[str, Any]) -> str:
        kind, source = case
        try:
            if kind == "grammar":
                constraint = GrammarConstraint(tokenizer, vocab, source)
            else:
                constraint = getattr(GrammarConstraint, kind)(tokenizer, vocab, source)
            for _ in range(2):  # matching on this thread's ordinary stack
                step = constraint.next_step()
                if step.stop:
                    break
                allowed = step.force[:1] or constraint.compute_mask().nonzero().flatten().tolist()[:1]
                if not allowed:
                    break
                constraint.on_token(allowed[0])
        except (ValueError, ConstraintError):
            return "refused"
        return "ok"

    return Target("grammar_depth", make, run, budget_s=DEPTH_BUDGET_S)
