"""LMTP, the Language Model Transport Protocol of LMQL, with four opt-in extensions (docs/lmtp.md).

Names load lazily, so `from tokenwire.lmtp import Client` does not import the engine (torch).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "Client": "client",
    "LmtpError": "client",
    "LmtpConnection": "core",
    "LmtpServer": "ws_server",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
