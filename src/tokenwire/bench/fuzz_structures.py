"""Structure-aware fuzz targets: inputs small on the wire whose *implied* work is large.

fuzz_targets.py damages bytes; the class issue 29 found by hand is different: a 1 KB Evergreen
message whose DAG shares nodes (each level listing the next one twice) flattens to 2^30
chunks, a regex whose counted repetition makes the constraint library's lexer explode, a
prompt of 10^7 ids. Each target here builds such shapes at random (sharing, fan-out spread
over several messages, nested grammars, oversized token arrays) and runs them through the
same sans-IO cores; every case must be answered ("ok" or the protocol's own "refused")
within its `budget_s`, or the run records an "over budget" failure (fuzz_bench.py enforces
the budget with SIGALRM, so a runaway case is cut off, not waited for).
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tokenwire.bench.fuzz_targets import Target
from tokenwire.engine.constraints import ConstraintError
from tokenwire.engine.errors import EngineError
from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.protocols.evergreen.core import SessionCore
from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.lmtp.core import LmtpConnection
from tokenwire.protocols.openai import core
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.schemas import CompletionRequest
from tokenwire.protocols.openai.transport import limits_of

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

# Per-case budgets: what one small input may cost the server before it is answered. Sound
# cases take 1-50 ms here (the slowest sound grammar, the finding's regex, compiles in 0.73 s);
# the runaways this finds take minutes. The margin is for a loaded 2-core machine (load 4).
GRAPH_BUDGET_S = 2.0
GRAMMAR_BUDGET_S = 5.0
PROMPT_BUDGET_S = 3.0

_FLATTENING_ACTIONS = ["GENERATE", "TOKENIZE", "COUNT_TOKENS", "DETOKENIZE", "SCORE"]


# ---------------------------------------------------------------- Evergreen DAGs with sharing


def _shared_dag(rng: random.Random) -> tuple[list[Any], str]:
    """Fragments of a layered DAG (node i of a layer lists `fan` children of the next, with
    repeats) over one or more messages; returns (messages, root id). Expansion is up to
    fan^depth chunks from a few dozen nodes."""
    depth = rng.choice([2, 5, 12, 20, 30])
    width = rng.choice([1, 1, 2, 3])
    fan = rng.choice([1, 2, 2, 3, 8])
    split = rng.choice([1, 1, 2, 3])  # messages the graph is spread over
    across = rng.random() < 0.3  # a node's child list in several fragments, in several messages
    messages = [spb.SessionMessage() for _ in range(split)]
    layers = [[f"d{level}_{i}" for i in range(width)] for level in range(depth + 1)]
    for nid in layers[-1]:  # text leaves at the bottom, in any of the messages
        chunk = pb.Chunk(data=rng.choice([b"x", b"Hello ", bytes(rng.randint(1, 64))]))
        chunk.metadata.mimetype = "text/plain"
        rng.choice(messages).node_fragments.append(pb.NodeFragment(id=nid, chunk_fragment=chunk))
    for level in range(depth - 1, -1, -1):
        for nid in layers[level]:
            children = [rng.choice(layers[level + 1]) for _ in range(fan)]
            if across and len(children) > 1:
                half = len(children) // 2
                parts = [(0, True, children[:half]), (1, False, children[half:])]
            else:
                parts = [(0, False, children)]
            for seq, continued, ids in parts:
                fragment = pb.NodeFragment(id=nid, seq=seq, continued=continued, child_ids=ids)
                messages[min(split - 1, (level + seq) % split)].node_fragments.append(fragment)
    if rng.random() < 0.2:  # an alias: a single-child chain on top of the shared graph
        messages[0].node_fragments.append(pb.NodeFragment(id="alias", child_ids=[layers[0][0]] * fan))
        return messages, "alias"
    return messages, layers[0][0]


def _dag_case(rng: random.Random) -> list[bytes]:
    messages, root = _shared_dag(rng)
    name = rng.choice(_FLATTENING_ACTIONS)
    if name == "SCORE":
        inputs = [pb.NamedParameter(name="prompt", id=root), pb.NamedParameter(name="continuation", id=root)]
        outputs = [pb.NamedParameter(name="score", id="out")]
    else:
        inputs = [pb.NamedParameter(name="prompt", id=root)]
        out = {"GENERATE": "response", "TOKENIZE": "tokens", "COUNT_TOKENS": "count", "DETOKENIZE": "text"}
        outputs = [pb.NamedParameter(name=out[name], id="out")]
    action = pb.Action(name=name, inputs=inputs, outputs=outputs)
    if rng.random() < 0.5:  # the action first, the graph after it (late binding)
        messages.insert(0, spb.SessionMessage(actions=[action]))
    else:
        messages[-1].actions.append(action)
    return [m.SerializeToString() for m in messages]


def evergreen_dag_target(engine: Engine) -> Target:
    def run(raws: list[bytes]) -> str:
        core = SessionCore({engine.name})
        started: list[Any] = []
        try:
            for raw in raws:
                started += core.receive(spb.SessionMessage.FromString(raw)).start
                for action in started:  # what the executor reads as fragments arrive: the flattened input
                    for name in action.spec.inputs:
                        core.input(action, name)
        except SessionAbort:
            return "refused"
        return "ok"

    return Target("evergreen_dag", _dag_case, run, budget_s=GRAPH_BUDGET_S)


# ---------------------------------------------------------------- constraint grammars


def _regex(rng: random.Random, depth: int = 0) -> str:
    """A random regex AST: nesting, alternation of overlapping branches, stars over stars and
    counted repetitions up to 10^6: the shapes that make a lexer's automaton blow up."""
    atoms = ["a", "aa", "b", "[a-z]", "[0-9]", r"\d", ".", "[^x]", r"\w"]
    if depth > rng.choice([1, 2, 3, 5]) or rng.random() < 0.25:
        return rng.choice(atoms)
    kind = rng.random()
    if kind < 0.3:
        return "(" + "|".join(_regex(rng, depth + 1) for _ in range(rng.randint(2, 4))) + ")"
    if kind < 0.6:
        return "".join(_regex(rng, depth + 1) for _ in range(rng.randint(2, 6)))
    inner = _regex(rng, depth + 1)
    count = rng.choice(["*", "+", "?", "{3}", "{2,9}", "{100}", "{1000}", "{1000000}", "{0,65535}"])
    return f"({inner}){count}"


def _regex_case(rng: random.Random) -> str:
    if rng.random() < 0.15:  # the finding's shape, scaled at random
        return "(a|aa)*" * rng.choice([5, 20, 50]) + "b{" + str(rng.choice([10, 10**4, 10**6])) + "}"
    return _regex(rng)


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    if depth > rng.choice([1, 3, 6, 12]) or rng.random() < 0.2:
        return rng.choice(
            [{"type": "string"}, {"type": "integer"}, {"type": "string", "pattern": _regex(rng, 3)},
             {"type": "string", "maxLength": rng.choice([5, 10**6])}, {"enum": ["a", "b", 1]}]
        )  # fmt: skip
    kind = rng.random()
    if kind < 0.4:
        props = {f"k{i}": _schema(rng, depth + 1) for i in range(rng.randint(1, 6))}
        return {"type": "object", "properties": props, "required": list(props)[: rng.randint(0, len(props))]}
    if kind < 0.7:
        return {"anyOf": [_schema(rng, depth + 1) for _ in range(rng.randint(2, 5))]}
    return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.choice([2, 50, 10**6])}


def _lark(rng: random.Random) -> str:
    rules = [f"r{i}" for i in range(rng.randint(1, 8))]
    lines = [f"start: {rules[0]}"]
    for i, rule in enumerate(rules):  # rules that refer to later ones and back (recursion)
        alts = []
        for _ in range(rng.randint(1, 3)):
            seq = [rng.choice([*rules[i:], f'"{rng.choice("ab")}"', "/[a-z]+/", f"/{_regex(rng, 2)}/"])
                   for _ in range(rng.randint(1, 4))]  # fmt: skip
            alts.append(" ".join(seq) + rng.choice(["", "*", "+", "?"]))
        lines.append(f"{rule}: " + " | ".join(alts))
    return "\n".join(lines)


def grammar_target(engine: Engine) -> Target:
    tokenizer, vocab = engine.tokenizer.hf, engine.logits_size  # as the protocols build them

    def make(rng: random.Random) -> tuple[str, str, int]:
        kind = rng.choice(["regex", "regex", "json_schema", "lark"])
        if kind == "regex":
            source = _regex_case(rng)
        elif kind == "json_schema":
            source = json.dumps(_schema(rng))
        else:
            source = _lark(rng)
        return kind, source, rng.randrange(2**32)

    def run(case: tuple[str, str, int]) -> str:
        kind, source, seed = case
        pick = random.Random(seed)
        try:  # a constrained request: build it (admission), then 8 steps of random allowed tokens
            constraint = getattr(GrammarConstraint, kind)(tokenizer, vocab, source)
            for _ in range(8):
                if constraint.next_step().stop:
                    break
                allowed = constraint.compute_mask().nonzero().flatten().tolist()
                if not allowed:
                    break
                constraint.on_token(pick.choice(allowed))
        except (ValueError, ConstraintError):
            return "refused"
        return "ok"

    return Target("grammar", make, run, budget_s=GRAMMAR_BUDGET_S)


# ---------------------------------------------------------------- oversized token arrays and prompts


def prompt_size_target(engine: Engine) -> Target:
    """LMTP GENERATE and OpenAI completions with token arrays and texts of 10^3 to 10^6
    elements, n and best_of multipliers: answered (refused) in bounded time, whatever the size."""
    limits = limits_of(engine)

    def make(rng: random.Random) -> tuple[str, str]:
        size = rng.choice([10**3, 10**4, 10**5, 10**6])  # 10^6 ids: a 3 MB message
        prompt: Any = [rng.randrange(engine.vocab_size)] * size if rng.random() < 0.6 else "ab " * (size // 3)
        if rng.random() < 0.5:
            payload = {"stream_id": 1, "model": engine.name, "prompt": prompt, "max_tokens": 2}
            return "lmtp", "GENERATE " + json.dumps(payload)
        body = {"model": engine.name, "prompt": prompt, "max_tokens": rng.choice([2, 10**6]),
                "n": rng.choice([1, 2, 128]), "best_of": rng.choice([None, 1, 128])}  # fmt: skip
        return "openai", json.dumps({k: v for k, v in body.items() if v is not None})

    def run(case: tuple[str, str]) -> str:
        protocol, text = case
        if protocol == "lmtp":
            conn = LmtpConnection(engine, lambda handle, stream: None)
            try:
                conn.feed(text)
                records = [json.loads(f.partition(" ")[2]) for f in conn.take_frames()]
                flat = [r for rec in records for r in (rec if isinstance(rec, list) else [rec])]
                return "refused" if any(isinstance(r, dict) and r.get("error") for r in flat) else "ok"
            finally:
                conn.close()
        try:
            core.plan_completion(CompletionRequest.model_validate(json.loads(text)), limits, None)
        except (ValidationError, OpenAIError, EngineError):
            return "refused"
        return "ok"

    return Target("prompt_size", make, run, budget_s=PROMPT_BUDGET_S)


def structure_targets(engine: Engine) -> list[Target]:
    return [evergreen_dag_target(engine), grammar_target(engine), prompt_size_target(engine)]
