"""Engine and ReplicaEngine implement every EngineAPI member themselves, with its signature.

Both subclass the Protocol, so a member one of them lacks would silently inherit the Protocol's
empty body (a method returning None): this test is what catches that. Data members are checked
by the class's own source assigning them (`self.name = ...`) or defining them, because a
ReplicaEngine cannot be built without a Ray cluster.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import EngineHandle, RequestHandle
from tokenwire.scale.facade import ReplicaEngine
from tokenwire.scale.handle import RemoteHandle

IMPLEMENTATIONS = [Engine, ReplicaEngine]
MEMBERS = sorted(typing._get_protocol_attrs(EngineAPI))  # type: ignore[attr-defined]
DATA = sorted(m for m in MEMBERS if m not in vars(EngineAPI))  # annotated, not defined


def _assigned_in(cls: type) -> set[str]:
    """Names the class body defines, and `self.<name> = ...` targets in its methods."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set(vars(cls))
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_the_protocol_names_what_protocols_use() -> None:
    # a guard against the member list shrinking by accident (the checks below iterate it)
    for member in ("generate", "create_session", "fork_session", "close_session", "stats", "tokenizer"):
        assert member in MEMBERS
    assert {"name", "tokenizer", "kv_block_size", "sessions_outlive_server"} <= set(DATA)


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implements_every_method_with_its_signature(cls: type) -> None:
    assert EngineAPI in cls.__mro__  # explicitly, not only structurally
    for name in MEMBERS:
        if name in DATA:
            continue
        declared = vars(EngineAPI)[name]
        own = next((vars(k)[name] for k in cls.__mro__ if k is not EngineAPI and name in vars(k)), None)
        assert own is not None and own is not declared, f"{cls.__name__}.{name} is missing"
        if isinstance(declared, property):
            assert isinstance(own, property), f"{cls.__name__}.{name} must be a property"
            continue
        assert _params(own) == _params(declared), f"{cls.__name__}.{name} signature differs"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_sets_every_data_member(cls: type) -> None:
    missing = [name for name in DATA if name not in _assigned_in(cls)]
    assert missing == []


@pytest.mark.parametrize("cls", [EngineHandle, RemoteHandle], ids=lambda c: c.__name__)
def test_handles_are_request_handles_with_nothing_abstract_left(cls: type) -> None:
    assert issubclass(cls, RequestHandle)
    assert not inspect.isabstract(cls), getattr(cls, "__abstractmethods__", None)
    # one way to read events: subscribe (iteration was the other two)
    assert not hasattr(cls, "__iter__") and not hasattr(cls, "__aiter__")
