"""tokenwire's import structure (issue 30): no import cycle, no import from a higher layer,
and a function-local import only where it keeps a heavy or optional dependency out of start-up,
with its reason written next to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.architecture import import_graph
from tests.architecture.import_graph import ImportGraph, arrows_up, build, find_cycle, local_imports

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenwire"

# Bottom to top: a module imports only from its own layer or the ones before it. Prefixes; the
# longest one that names a module decides its layer.
LAYERS: list[tuple[str, list[str]]] = [
    # no tokenwire imports at all: the package root, errors shared by model and engine, logging...
    (
        "base",
        [
            "tokenwire",
            "tokenwire.errors",
            "tokenwire.logs",
            "tokenwire.progress",
            "tokenwire.heap",
            "tokenwire.config",
            "tokenwire.model_spec",
            "tokenwire.shutdown",
        ],
    ),
    ("model", ["tokenwire.model"]),
    ("engine", ["tokenwire.engine"]),
    # the wire protocols, what they share (flags, metrics) and their public client modules
    (
        "protocols",
        [
            "tokenwire.protocols",
            "tokenwire.cli_args",
            "tokenwire.metrics",
            "tokenwire.lmtp",
            "tokenwire.evergreen",
            "tokenwire.graphpipe",
            "tokenwire.salience",
        ],
    ),
    ("scale", ["tokenwire.scale"]),
    ("server", ["tokenwire.plugins", "tokenwire.server"]),
    # the benchmarks run servers in-process (bench/inprocess.py starts the server plugins)
    ("bench", ["tokenwire.bench"]),
    ("commands", ["tokenwire.cli", "tokenwire.generate_cmd", "tokenwire.concepts_cmd"]),
]

# Function-local import statements left in src/tokenwire (288 before issue 30), each with its
# `# local: why`: raise this only for one that keeps a heavy or optional dependency (torch, ray,
# transformers, grpc, aiohttp, a dev or bench extra) out of a path that starts without it.
MAX_LOCAL_IMPORTS = 89  # 89: --ollama-port's server (FastAPI, uvicorn) out of `serve --help`


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build(SRC, "tokenwire")


def test_no_import_cycle(graph: ImportGraph) -> None:
    # TYPE_CHECKING imports count: a cycle through a type-only import is still two modules that
    # each need the other (issue 30 counts aici/rest <-> aici/supervisor, one of them)
    edges = graph.edges()
    cycle = find_cycle(edges)
    groups = "\n".join(", ".join(group) for group in import_graph.strongly_connected(edges))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}\nmodules in cycles:\n{groups}"


def test_no_import_from_a_higher_layer(graph: ImportGraph) -> None:
    up = arrows_up(graph, LAYERS)
    assert not up, "imports from a higher layer:\n" + "\n".join(up)


def test_local_imports_are_few_and_explained(graph: ImportGraph) -> None:
    found = local_imports(graph.modules.values())
    unexplained = [f"{path}:{line}" for path, line, explained in found if not explained]
    assert not unexplained, (
        f"function-local imports without a `{import_graph.LOCAL_REASON} why` comment "
        "(move them to the top unless they keep a heavy dependency out of start-up):\n"
        + "\n".join(unexplained)
    )
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} function-local imports (at most {MAX_LOCAL_IMPORTS})"
    )


# The checker itself, on a package written here: each check must fail on what it is there to catch.


def _package(root: Path, files: dict[str, str]) -> ImportGraph:
    for name, source in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return build(root / "pkg", "pkg")


def test_checker_finds_a_cycle_through_a_function_local_and_a_relative_import(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from .. import a\n",
            "b.py": "from pkg.sub.c import f\n",
            "d.py": "import pkg.a\n",
        },
    )
    assert find_cycle(graph.edges()) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert import_graph.strongly_connected(graph.edges()) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_checker_passes_an_acyclic_package(tmp_path: Path) -> None:
    graph = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import os\n"})
    assert find_cycle(graph.edges()) is None
    assert graph.edges() == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": set()}


def test_checker_finds_an_arrow_up(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n",
            "high.py": "from pkg import low\n",
        },
    )
    layers = [("base", ["pkg"]), ("low", ["pkg.low"]), ("high", ["pkg.high"])]
    up = arrows_up(graph, layers)
    assert len(up) == 1 and "pkg.low (low) imports pkg.high (high)" in up[0]
    assert arrows_up(graph, list(reversed(layers))) != []


def test_checker_finds_an_unexplained_local_import(tmp_path: Path) -> None:
    source = (
        "def explained():\n"
        "    # local: torch is heavy\n"
        "    import torch\n"
        "\n"
        "    from torch import nn\n"
        "def trailing():\n"
        "    import ray  # local: optional extra\n"
        "def bare():\n"
        "    x = 1\n"
        "    import json\n"
        "def two_lines():\n"
        "    # local: grpc's C core,\n"
        "    # which --help does without\n"
        "    import grpc\n"
        "def other_comment():\n"
        "    # not a reason\n"
        "    import numpy\n"
        "import os\n"
    )
    graph = _package(tmp_path, {"__init__.py": "", "m.py": source})
    found = [(line, ok) for _, line, ok in local_imports([graph.modules["pkg.m"]])]
    assert found == [(3, True), (5, True), (7, True), (10, False), (14, True), (17, False)]
