"""Preparing a jsctrl program for QuickJS's script mode.

The published samples start with ES module imports (`import { Label } from "aici"`). Everything
those modules export is also a global in our glue, so each import of "aici" or "_aici" becomes a
destructuring of the glue's module object; the program then runs as a plain script, which is what
lets `start(main)` run synchronously at instantiate time.
"""

from __future__ import annotations

import re

_IMPORT = re.compile(
    r"""^[ \t]*import\s+(?P<what>[\w$\s{},*]+?)\s+from\s+(?P<q>["'])(?P<mod>_?aici)(?P=q)[ \t]*;?""",
    re.MULTILINE,
)
_OTHER_IMPORT = re.compile(r"""^[ \t]*import\s.*?from\s+["']([^"']+)["']""", re.MULTILINE)


class SourceError(ValueError):
    """The program imports a module other than "aici" / "_aici"."""


def _binding(what: str, mod: str) -> str:
    src = f"globalThis.__tw_modules[{mod!r}]"
    what = what.strip()
    out: list[str] = []
    m = re.fullmatch(r"\*\s+as\s+([\w$]+)", what)
    if m:
        return f"const {m.group(1)} = {src};"
    default, _, rest = what.partition(",") if not what.startswith("{") else ("", "", what)
    if default.strip():
        out.append(f"const {default.strip()} = {src};")
    rest = rest.strip()
    m = re.fullmatch(r"\*\s+as\s+([\w$]+)", rest)
    if m:
        out.append(f"const {m.group(1)} = {src};")
    elif rest:
        names = [n.strip() for n in rest.strip("{} \n\t").split(",") if n.strip()]
        parts = [
            (f"{a}: {b}" if (a := n.split(" as ")[0].strip()) != (b := n.split(" as ")[-1].strip()) else a)
            for n in names
        ]
        # existing globals would make `const X` shadow them; the same objects either way
        out.append("const { " + ", ".join(parts) + f" }} = {src};")
    return " ".join(out)


def prepare_source(source: str) -> str:
    """The program with its "aici" imports turned into bindings (line numbers kept)."""
    rewritten = _IMPORT.sub(lambda m: _binding(m.group("what"), m.group("mod")), source)
    other = _OTHER_IMPORT.search(rewritten)
    if other:
        raise SourceError(f'cannot import {other.group(1)!r}: only "aici" and "_aici" exist in jsctrl')
    return rewritten
