"""Every grammar is measured before it is compiled, and compiled where a deep recursion cannot
end the process.

llguidance compiles a grammar by recursing once per link of a chain of rules or `$ref`s, on the
caller's stack: a Lark grammar of 3,000 chained rules (40 KB) or a JSON schema whose `$ref`s
chain 3,000 deep overflowed an 8 MiB thread stack and took the whole server down with SIGSEGV
(measured here: ~2.7 KB of stack per link; 2,000 links pass on 8 MiB, 3,000 never do). Two
defences, one shared by every protocol (they all build constraints through
engine/grammar.GrammarConstraint, which calls this module):

* :func:`measure_regex`, :func:`measure_json_schema`, :func:`measure_lark` and
  :func:`measure_llguidance` count size, nesting depth, the longest chain of references and the
  number of rules without recursing (explicit stacks), and :func:`check` refuses a grammar over
  a limit with :class:`GrammarTooLarge` (a ValueError: every protocol answers it as its
  invalid-argument error) naming the limit and its flag;
* :func:`compile_deep` runs the compilation on a thread whose stack is sized far beyond the
  limits (256 MiB of address space, committed only as touched: 20,000 chained rules compiled in
  0.14 s on 64 MiB), so even a grammar just under every limit cannot reach the stack's end.

Matching (masks, forced tokens, copies) does not recurse per link: a 20,000-rule chain
compiled this way is matched on an ordinary 8 MiB thread (checked by the tests).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# 256 MiB of address space: ~95,000 links at the 2.7 KB a link measured, 47x the default chain
# limit. Only the pages a compile touches are committed.
COMPILE_STACK_BYTES = 256 << 20


@dataclass(frozen=True)
class GrammarLimits:
    """docs/limits.md: the `--grammar-max-*` flags of `tokenwire serve`."""

    # source size in bytes (a schema's JSON text). 1 MiB: a 20,000-alternative Lark grammar is
    # 650 KB and compiles in 0.44 s; the largest real schemas we know of are ~300 KB
    max_bytes: int = 1 << 20
    # brackets inside brackets: a JSON schema's objects and arrays, a Lark rule's ( [ {, a
    # regex's groups. Real schemas nest < 100 levels
    max_depth: int = 1_000
    # the longest chain of references a compile follows: Lark rule -> rule, JSON subschema ->
    # nested subschema or `$ref` target. Real grammars: tens (a C grammar's precedence ladder)
    max_chain: int = 2_000
    # Lark rules and terminals; JSON subschemas (objects)
    max_rules: int = 20_000


_limits = GrammarLimits()

FLAGS = {
    "max_bytes": "--grammar-max-bytes",
    "max_depth": "--grammar-max-depth",
    "max_chain": "--grammar-max-chain",
    "max_rules": "--grammar-max-rules",
}
_WHAT = {
    "max_bytes": "bytes",
    "max_depth": "levels of nesting",
    "max_chain": "links in its longest chain of references",
    "max_rules": "rules",
}


def describe(name: str) -> str:
    """What a limit counts ("bytes", "levels of nesting", ...)."""
    return _WHAT[name]


def configure(limits: GrammarLimits) -> None:
    global _limits
    _limits = limits


def limits() -> GrammarLimits:
    return _limits


class GrammarTooLarge(ValueError):
    """A grammar over one of the limits; the message names the limit's flag."""


@dataclass
class Measure:
    bytes: int = 0
    max_depth: int = 0
    max_chain: int = 0
    max_rules: int = 0

    def merge(self, other: Measure) -> None:
        self.bytes = max(self.bytes, other.bytes)
        self.max_depth = max(self.max_depth, other.max_depth)
        self.max_chain = max(self.max_chain, other.max_chain)
        self.max_rules += other.max_rules


def check(kind: str, measure: Measure, bound: GrammarLimits | None = None) -> None:
    """GrammarTooLarge for the first limit `measure` exceeds."""
    bound = bound or _limits
    values = {"max_bytes": measure.bytes, "max_depth": measure.max_depth}
    values |= {"max_chain": measure.max_chain, "max_rules": measure.max_rules}
    for name, value in values.items():
        limit = getattr(bound, name)
        if value > limit:
            raise GrammarTooLarge(
                f"{kind} too large: {value:,} {_WHAT[name]}, over the limit of {limit:,} ({FLAGS[name]})"
            )


def compile_deep(fn: Callable[[], T]) -> T:
    """fn() on a thread with a COMPILE_STACK_BYTES stack; its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    with _STACK_LOCK:  # stack_size is process-wide: set it just for this thread's creation
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


_STACK_LOCK = threading.Lock()


# ---- measuring -------------------------------------------------------------------------------


def measure_regex(pattern: str) -> Measure:
    m = Measure(bytes=len(pattern.encode("utf-8", "surrogatepass")), max_rules=1)
    depth = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            m.max_depth = max(m.max_depth, depth + 1)
        elif ch == "(":
            depth += 1
            m.max_depth = max(m.max_depth, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
    m.max_chain = m.max_depth
    return m


def measure_json_schema(schema: Any, text_bytes: int | None = None) -> Measure:
    """A schema (parsed JSON): its nesting, its subschemas and the longest chain of nested
    subschemas and local `$ref`s (cycles, as in a recursive tree schema, are compiled lazily by
    llguidance and cut here where they close)."""
    m = Measure()
    nodes: dict[int, Any] = {}
    size = 0  # its compact JSON text's length, counted without json.dumps (which recurses)
    for value, depth in _walk(schema):
        m.max_depth = max(m.max_depth, depth)
        if isinstance(value, dict):
            nodes[id(value)] = value
            size += 2 + sum(len(json.dumps(key)) + 2 for key in value)
        elif isinstance(value, list):
            size += 2 + len(value)
        else:
            size += len(json.dumps(value))
    m.bytes = size if text_bytes is None else text_bytes
    m.max_rules = len(nodes)
    m.max_chain = _longest_path([schema], lambda node: _schema_edges(schema, node))
    return m


def _walk(value: Any) -> Iterator[tuple[Any, int]]:
    """Every JSON value with its nesting depth (containers count one level each)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        yield v, depth
        if isinstance(v, dict):
            stack.extend((child, depth + 1) for child in v.values())
        elif isinstance(v, list):
            stack.extend((child, depth + 1) for child in v)


def _schema_edges(root: Any, node: dict[str, Any]) -> list[Any]:
    """The subschemas a schema object leads to: the objects nested in it (through lists too)
    and the target of its local `$ref`."""
    out: list[Any] = []
    stack: list[Any] = list(node.values())
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out.append(v)
        elif isinstance(v, list):
            stack.extend(v)
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, dict):
            out.append(target)
    return out


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer (`#/$defs/a`); None for anything else (llguidance refuses remote
    references itself)."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _longest_path(starts: list[Any], edges: Callable[[Any], list[Any]]) -> int:
    """Nodes on the longest path from any of `starts` (dicts), edges closing a cycle ignored;
    iterative depth-first search with each node's result kept and shared between starts
    (linear in nodes + edges)."""
    best: dict[int, int] = {}
    longest = 0
    for start in starts:
        if not isinstance(start, dict) or id(start) in best:
            continue
        on_path = {id(start)}
        reach = {id(start): 1}
        stack: list[tuple[Any, Iterator[Any]]] = [(start, iter(edges(start)))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(id(node))
                best[id(node)] = reach[id(node)]
                if stack:
                    parent = id(stack[-1][0])
                    reach[parent] = max(reach[parent], best[id(node)] + 1)
                continue
            key = id(child)
            if key in on_path:
                continue
            if key in best:
                reach[id(node)] = max(reach[id(node)], best[key] + 1)
                continue
            on_path.add(key)
            reach[key] = 1
            stack.append((child, iter(edges(child))))
        longest = max(longest, best[id(start)])
    return longest


# Lark (llguidance's dialect): a definition is `name:` (rules; `?`/`!` prefixes, `.priority`) at
# the start of a line; lines starting with `|` continue it. Strings, regex literals and comments
# are skipped when looking for references and brackets.
_LEXEME = re.compile(
    r"""(?P<str>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*')"""
    r"""|(?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)"""
    r"""|(?P<comment>//[^\n]*|\#[^\n]*)"""
    r"""|(?P<def>^[ \t]*[?!]?(?P<defname>[A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:(?!:))"""
    r"""|(?P<name>%?[A-Za-z_][A-Za-z0-9_]*)"""
    r"""|(?P<open>[(\[{])|(?P<close>[)\]}])""",
    re.MULTILINE,
)


def measure_lark(grammar: str) -> Measure:
    m = Measure(bytes=len(grammar.encode("utf-8", "surrogatepass")))
    refs: dict[str, list[str]] = {}
    current: list[str] | None = None
    depth = 0
    for lexeme in _LEXEME.finditer(grammar):
        kind = lexeme.lastgroup
        if kind == "defname" or lexeme.group("def"):
            name = lexeme.group("defname")
            current = refs.setdefault(name, [])
            depth = 0
        elif kind == "name":
            word = lexeme.group("name")
            if current is not None and not word.startswith("%"):
                current.append(word)
        elif kind == "open":
            depth += 1
            m.max_depth = max(m.max_depth, depth)
        elif kind == "close":
            depth = max(0, depth - 1)
    m.max_rules = len(refs)
    holders = {name: {"name": name} for name in refs}  # the search keys nodes by identity

    def edges(node: dict[str, str]) -> list[Any]:
        return [holders[t] for t in refs[node["name"]] if t in holders]

    m.max_chain = _longest_path(list(holders.values()), edges)
    return m


def measure_llguidance(grammar: str) -> Measure:
    """llguidance's own grammar format (a JSON object with `grammars`: lark_grammar /
    json_schema entries, as AICI's declarative controllers send), or a bare Lark text."""
    try:
        parsed = json.loads(grammar)
    except (json.JSONDecodeError, RecursionError):
        return measure_lark(grammar)
    m = Measure(bytes=len(grammar.encode("utf-8", "surrogatepass")))
    for value, depth in _walk(parsed):
        m.max_depth = max(m.max_depth, depth)
        if isinstance(value, dict):
            if isinstance(value.get("lark_grammar"), str):
                m.merge(measure_lark(value["lark_grammar"]))
            if isinstance(value.get("json_schema"), dict | bool):
                m.merge(measure_json_schema(value["json_schema"]))
    return m
