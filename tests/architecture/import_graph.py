"""The import graph of a package, read from its source with an AST walk.

Nothing is imported: each module's file is parsed, and every `import` /
`from ... import` statement in it (top level, inside `if`/`try`, inside
functions) becomes an edge to the module it names. The checks on it (find_cycle,
strongly_connected, arrows_up, local_imports) are here; tokenwire's rules (its layers,
how many local imports) are in test_imports.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import statement's edge: where it is and what it names."""

    importer: str  # dotted module name
    imported: str  # dotted module name inside the package
    path: Path
    line: int
    local: bool  # inside a function body (runs at call time, not at import time)
    type_only: bool  # under `if TYPE_CHECKING:` (never runs)


@dataclass
class ImportGraph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)

    def __repr__(self) -> str:  # a failing test prints its arguments: a line, not 1,000 edges
        return f"ImportGraph({len(self.modules)} modules, {len(self.imports)} imports)"

    def edges(self, *, type_only: bool = True) -> dict[str, set[str]]:
        """importer -> the modules it imports (self-imports left out)."""
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            if imp.importer != imp.imported and (type_only or not imp.type_only):
                out[imp.importer].add(imp.imported)
        return out


def module_name(root: Path, path: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, local: bool, type_only: bool) -> Iterable[tuple[ast.stmt, bool, bool]]:
    """Every import statement under node, with whether it is function-local / TYPE_CHECKING-only."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, local, type_only
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
        else:
            yield from _walk(child, local, type_only)


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def build(root: Path, package: str) -> ImportGraph:
    """The graph of every .py file under root (the package's directory)."""
    graph = ImportGraph()
    for path in sorted(root.rglob("*.py")):
        graph.modules[module_name(root, path, package)] = path
    for importer, path in graph.modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for stmt, local, type_only in _walk(tree, False, False):
            targets: list[str] = []
            if isinstance(stmt, ast.Import):
                targets = [alias.name for alias in stmt.names]
            else:
                assert isinstance(stmt, ast.ImportFrom)
                base = stmt.module or ""
                if stmt.level:
                    # `from . import x` in a/b/c.py is package a.b; in a/b/__init__.py it is a.b too
                    anchor = importer.split(".")
                    drop = stmt.level - 1 if is_package else stmt.level
                    anchor = anchor[: len(anchor) - drop]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import name` imports the submodule pkg.name when there is one
                targets = [f"{base}.{alias.name}" for alias in stmt.names]
            for target in targets:
                resolved = _resolve(target, graph.modules)
                if resolved is not None:
                    graph.imports.append(Import(importer, resolved, path, stmt.lineno, local, type_only))
    return graph


def find_cycle(edges: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None when the graph has none."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: finished
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in colour:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(edges):
        if start not in colour:
            found = visit(start)
            if found:
                return found
    return None


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: every cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]]) -> int:
    """The index of the layer whose longest prefix names the module (ValueError: in none)."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise ValueError(f"{module} is in no layer")
    return best


def arrows_up(graph: ImportGraph, layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as readable lines."""
    out = []
    for imp in graph.imports:
        low, high = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
        if high > low:
            out.append(
                f"{imp.path}:{imp.line}: {imp.importer} ({layers[low][0]}) imports "
                f"{imp.imported} ({layers[high][0]})"
            )
    return out


LOCAL_REASON = "# local:"


def _local_statements(tree: ast.Module) -> list[ast.stmt]:
    return [stmt for stmt, local, _ in _walk(tree, False, False) if local]


def local_imports(paths: Iterable[Path]) -> list[tuple[Path, int, bool]]:
    """Every function-local import statement (any module, ours or not) as (file, line, explained).

    Explained: a `# local: why` comment ends the statement's first line, or stands alone on the
    line above it, or above the run of import lines the statement is part of (one reason for a
    group of imports that load together, blank lines between their sections included); the
    reason may go on over comment lines.
    """
    out = []
    for path in paths:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for stmt in _local_statements(ast.parse(source, filename=str(path))):
            row = stmt.lineno - 1
            explained = LOCAL_REASON in lines[row]
            above = row - 1
            # climb over the import lines (and their parenthesised continuations), blank lines
            # between their groups and comment lines: a reason may take two lines
            while not explained and above >= 0:
                text = lines[above].strip()
                if text.startswith(LOCAL_REASON):
                    explained = True
                elif not text or text.startswith(("import ", "from ", "#", ")")) or text.endswith(","):
                    above -= 1
                    continue
                break
            out.append((path, stmt.lineno, explained))
    return out
