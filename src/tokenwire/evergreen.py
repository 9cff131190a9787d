"""The Evergreen client library: `from tokenwire.evergreen import EvergreenSession`."""

from tokenwire.protocols.evergreen.client import (
    Chat,
    ConstraintConfig,
    EvergreenError,
    EvergreenSession,
    GenerateConfig,
    Node,
    Output,
)

__all__ = [
    "Chat",
    "ConstraintConfig",
    "EvergreenError",
    "EvergreenSession",
    "GenerateConfig",
    "Node",
    "Output",
]
