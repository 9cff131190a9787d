"""The README's lists are held to the code's own tables, so a newcomer reads what runs.

Each list lives under a known heading of README.md in a form read here:

- **Architectures** ("### Architectures"): a table whose rows give an architecture, its family
  and where it loads from. It must name exactly the architectures of the family registry
  (`tokenwire.model.families.ARCHITECTURES`), each with its family's name, and say "GGUF" exactly
  where the family reads GGUF files.
- **Weight types** ("### Weight types"): a table of exactly the rows of `WEIGHT_TYPES`
  (`model/weight_types.py`, itself held to the C++ `type_table.h` by
  tests/model/test_weight_types.py): name, GGUF id, weights and bytes a block, and "yes" where
  the type has an AVX-512 lane kernel.
- **HTTP endpoints** ("### HTTP endpoints"): a table of (port flag, methods, paths) equal to the
  routes the HTTP apps register: the OpenAI API's FastAPI app (`--http-port`) and the aiohttp
  apps every other HTTP listener hands to `http_site.start_site` (metrics, GraphPipe, AICI REST,
  LMTP), read from the apps themselves with no socket bound. HEAD is left out (aiohttp adds it to
  every GET); a mount lists as `{mount}/{path}`; aiohttp's method `*` as "any".
- **`tokenwire serve` flags** ("### Flags of `tokenwire serve`"), read from the parser
  `tokenwire serve` builds at runtime (`cli.build_parser(["serve"])`, the plugins' flags
  included), under this rule:

  1. every `--flag` that section names in code (a `code span`) is a flag of `tokenwire serve`,
     and so is every `--flag` of the `tokenwire serve` entry in the README's command-line
     synopsis (where that entry writes `--flag a|b|c` for a flag with fixed choices, they are
     the parser's choices);
  2. every flag of `tokenwire serve` is named in code (a code span or a fenced block) either in
     that section or in a doc that section links to (docs/limits.md, docs/engine.md, ...). So a
     new flag is documented by a row of the README's table or by a line in the linked doc that
     covers it: a new limit needs only its docs/limits.md row.

A test fails naming what the code has and the README lacks, or the reverse. Nothing loads a
model or opens a port; it runs in a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOC_LINK = re.compile(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[^)]*)?\)")


# ---------------------------------------------------------------------------- reading markdown
def section(text: str, heading: str) -> str:
    """The body under `heading` (a whole heading line), up to the next heading of its level or
    above."""
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        pytest.fail(f"README.md has no heading {heading!r}")
    level = len(heading) - len(heading.lstrip("#"))
    body: list[str] = []
    fenced = False
    for line in lines[start + 1 :]:
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        body.append(line)
    return "\n".join(body)


def table_rows(body: str) -> list[list[str]]:
    """The cells of the first table in `body`, header and rule left out."""
    rows: list[list[str]] = []
    for line in body.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))  # `a\|b` stays one cell
        rows.append([cell.strip().replace("\\|", "|") for cell in cells])
    if len(rows) < 3:
        pytest.fail(f"no table found in:\n{body[:400]}")
    return rows[2:]


def code_in(cell: str) -> list[str]:
    return CODE_SPAN.findall(cell)


def code_text(text: str) -> str:
    """Everything `text` holds as code: its fenced blocks and its code spans."""
    fenced = FENCE.findall(text)
    spans = CODE_SPAN.findall(FENCE.sub("", text))
    return "\n".join(fenced + spans)


def readme() -> str:
    return README.read_text(encoding="utf-8")


def differences(what: str, in_code: set[Any], in_readme: set[Any]) -> list[str]:
    problems = []
    if missing := in_code - in_readme:
        problems.append(f"{what} the code has and README.md lacks: {sorted(missing, key=str)}")
    if extra := in_readme - in_code:
        problems.append(f"{what} README.md names and the code lacks: {sorted(extra, key=str)}")
    return problems


# ---------------------------------------------------------------------------- architectures
def test_the_architectures_table_is_the_family_registry() -> None:
    from tokenwire.model.families import ARCHITECTURES

    rows = table_rows(section(readme(), "### Architectures"))
    listed: dict[str, tuple[str, bool]] = {}
    for row in rows:
        arch, family = code_in(row[0]), code_in(row[1])
        assert len(arch) == 1 and len(family) == 1, f"row without one `architecture` and one `family`: {row}"
        sources = {s.strip() for s in row[2].split(",")}
        assert sources <= {"HF", "GGUF"}, f"{arch[0]}: 'from' must be HF and/or GGUF, got {row[2]!r}"
        assert arch[0] not in listed, f"{arch[0]} listed twice"
        listed[arch[0]] = (family[0], "GGUF" in sources)
    in_code = {arch: (family.name, family.gguf is not None) for arch, family in ARCHITECTURES.items()}
    problems = differences("architectures", set(in_code), set(listed))
    for arch in sorted(set(in_code) & set(listed)):
        if in_code[arch] != listed[arch]:
            (family, gguf), (said, said_gguf) = in_code[arch], listed[arch]
            problems.append(
                f"{arch}: the registry says family {family!r}, GGUF {gguf}; "
                f"README.md says {said!r}, GGUF {said_gguf}"
            )
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- weight types
def test_the_weight_types_table_is_the_weight_type_table() -> None:
    from tokenwire.model.weight_types import WEIGHT_TYPES

    rows = table_rows(section(readme(), "### Weight types"))
    listed: dict[str, tuple[int, int, int, bool]] = {}
    for row in rows:
        name = code_in(row[0])
        assert len(name) == 1, f"row without one `type`: {row}"
        assert row[4] in ("yes", ""), f"{name[0]}: the tiled kernel column is 'yes' or empty, got {row[4]!r}"
        listed[name[0]] = (int(row[1]), int(row[2]), int(row[3]), row[4] == "yes")
    in_code = {t.name: (t.gguf_id, t.block, t.block_bytes, t.tiled) for t in WEIGHT_TYPES}
    problems = differences("weight types", set(in_code), set(listed))
    for name in sorted(set(in_code) & set(listed)):
        if in_code[name] != listed[name]:
            problems.append(
                f"{name}: (GGUF id, block, bytes, tiled) are {in_code[name]} in WEIGHT_TYPES, "
                f"{listed[name]} in README.md"
            )
    assert not problems, "\n".join(problems)


def test_the_weights_flag_help_names_every_weight_type() -> None:
    """`--weights gguf`'s help lists the types by name (cli_args.py cannot import torch)."""
    from tokenwire.cli_args import GGUF_WEIGHT_TYPES
    from tokenwire.model.weight_types import WEIGHT_TYPES

    assert GGUF_WEIGHT_TYPES.split("/") == [t.name for t in WEIGHT_TYPES]


# ---------------------------------------------------------------------------- HTTP endpoints
class _StubEngine:
    """What the apps' constructors read of an engine; no handler runs here."""

    name = "stub"
    tokenizer = None
    max_model_len = vocab_size = logits_size = 1
    eos_ids: frozenset[int] = frozenset()
    limits = None
    concepts = None

    def image_block(self) -> None:
        return None


class _Captured(Exception):
    def __init__(self, app: Any) -> None:
        super().__init__("captured")
        self.app = app


async def _capture_start_site(app: Any, *args: Any, **kwargs: Any) -> Any:
    raise _Captured(app)  # the app as built, before anything binds


def _openai_routes() -> Iterator[tuple[str, str, str]]:
    from starlette.routing import Mount

    from tokenwire.protocols.openai.transport import OpenAIApp

    app = OpenAIApp(_StubEngine()).app  # type: ignore[arg-type]
    for route in app.routes:
        if isinstance(route, Mount):
            yield "--http-port", "GET", f"{route.path}/{{path}}"
            continue
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                yield "--http-port", method, route.path  # type: ignore[attr-defined]


def _aiohttp_routes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, str]]:
    """The aiohttp apps, each built by its own start() (or the metrics server's coroutine) up
    to the http_site.start_site call, which hands them over here instead of serving."""
    import tokenwire.metrics as metrics
    import tokenwire.protocols.aici.rest as aici_rest
    import tokenwire.protocols.graphpipe.server as graphpipe_server
    import tokenwire.protocols.lmtp.ws_server as lmtp_server
    from tokenwire.protocols.graphpipe.models.base import TensorModel

    for module in (metrics, aici_rest, graphpipe_server, lmtp_server):
        monkeypatch.setattr(module, "start_site", _capture_start_site)

    class _Model(TensorModel):
        def __init__(self) -> None:
            self.name = "stub"
            self.inputs, self.outputs, self.default_inputs, self.default_outputs = [], [], [], []

        def start(self, inputs: Any, outputs: Any, config: Any) -> Any:
            raise NotImplementedError

    engine: Any = _StubEngine()
    starts: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
        "--metrics-port": lambda: metrics._serve_metrics(engine, None, None),  # type: ignore[arg-type]
        "--graphpipe-port": lambda: graphpipe_server.GraphPipeServer([_Model()]).start(),
        "--aici-port": lambda: aici_rest.AiciServer(engine, None).start(),
        "--lmtp-port": lambda: lmtp_server.LmtpServer(engine).start(),
    }

    async def built(start: Coroutine[Any, Any, Any]) -> Any:
        try:
            await start
        except _Captured as captured:
            return captured.app
        pytest.fail("a server started without going through http_site.start_site")

    for port, start in starts.items():
        app = asyncio.run(built(start()))
        for route in app.router.routes():
            if route.method != "HEAD":
                yield port, "any" if route.method == "*" else route.method, route.resource.canonical


def test_the_http_endpoints_table_is_the_registered_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    routes = set(_openai_routes()) | set(_aiohttp_routes(monkeypatch))
    listed: set[tuple[str, str, str]] = set()
    for row in table_rows(section(readme(), "### HTTP endpoints")):
        ports, paths = code_in(row[0]), code_in(row[2])
        methods = [m.strip() for m in row[1].split(",")]
        assert len(ports) == 1 and paths and all(methods), f"row without a `port`, methods and `paths`: {row}"
        listed |= {(ports[0], method, path) for method in methods for path in paths}
    problems = differences("HTTP routes (port, method, path)", routes, listed)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- serve flags
def serve_parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """`tokenwire serve`'s parser as the command builds it (a --config file or $TOKENWIRE_*
    would change defaults only, but none is read here)."""
    from tokenwire.cli import build_parser

    monkeypatch.delenv("TOKENWIRE_CONFIG", raising=False)
    parser = build_parser(["serve"])
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("tokenwire has no serve command")


def serve_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def serve_synopsis(text: str) -> str:
    """The `tokenwire serve ...` entry of the command-line synopsis: its first line and the
    indented lines after it."""
    block = FENCE.findall(section(text, "## Command line"))
    assert block, "README.md's command line has no synopsis block"
    lines = block[0].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("tokenwire serve")), None)
    assert start is not None, "the synopsis has no `tokenwire serve` entry"
    entry = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        entry.append(line)
    return "\n".join(line.split("#")[0] for line in entry)  # comments are no flags


def test_the_readme_names_only_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = serve_flags(serve_parser(monkeypatch))
    text = readme()
    table = section(text, "### Flags of `tokenwire serve`")
    named = {flag for span in code_in(table) for flag in FLAG.findall(span)}
    synopsis = serve_synopsis(text)
    problems = [
        f"{where} names {flag}, which `tokenwire serve` does not have"
        for where, found in (("the flags table", named), ("the serve synopsis", set(FLAG.findall(synopsis))))
        for flag in sorted(found - set(flags))
    ]
    for flag, values in re.findall(r"\[(--[a-z0-9-]+) ([\w.]+(?:\|[\w.]+)+)\]", synopsis):
        choices = getattr(flags.get(flag), "choices", None)
        if choices is not None and set(values.split("|")) != {str(c) for c in choices}:
            problems.append(f"the serve synopsis gives {flag} {values}; its choices are {'|'.join(choices)}")
    assert not problems, "\n".join(problems)


def test_every_serve_flag_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = serve_flags(serve_parser(monkeypatch))
    table = section(readme(), "### Flags of `tokenwire serve`")
    docs = sorted({link for link in DOC_LINK.findall(table)})
    assert "docs/limits.md" in docs, "the flags table must link docs/limits.md (the limits' flags)"
    where = {"README.md": code_text(table)}
    for doc in docs:
        path = ROOT / doc
        assert path.is_file(), f"the flags table links {doc}, which does not exist"
        where[doc] = code_text(path.read_text(encoding="utf-8"))
    documented = {flag for text in where.values() for flag in FLAG.findall(text)}
    missing = sorted(set(flags) - documented)
    assert not missing, (
        f"`tokenwire serve` flags documented nowhere: {missing}. Name each in README.md's "
        f"'Flags of `tokenwire serve`' table or, in code, in one of the docs it links: {docs}"
    )
