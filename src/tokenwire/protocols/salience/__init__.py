"""Salience (salience.v1): stateful token sessions over gRPC, with logprobs and concept readouts.

Names load lazily, so `from tokenwire.salience import Client` does not import the engine (torch).
See docs/salience.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "Client": "client",
    "AsyncClient": "client",
    "SalienceError": "client_session",
    "SessionView": "client_session",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
