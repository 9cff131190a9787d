"""Modules and tags: the on-disk store (--store-dir) and module id/tag -> controller factory.

Uploaded Wasm lives in STORE/modules/<sha256>.wasm; tags in STORE/tags.json, rewritten
atomically on every change, so they survive restarts. Built-in controllers (jsctrl, the
declarative ones) have no Wasm: their module id is the sha256 of "tokenwire-builtin:<name>",
so they can be listed and re-tagged like any uploaded module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenwire.protocols.aici.controller import Controller, ControllerError, ControllerLimits, TokenizerEnv
from tokenwire.protocols.aici.controller import VariableStore as Variables
from tokenwire.protocols.aici.declarative import DeclarativeController

# (env, variables, limits, module_arg as text) -> a fresh controller
Factory = Callable[[TokenizerEnv, Variables, ControllerLimits, str], Controller]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TAG = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
WASM_MAGIC = b"\0asm"

__all__ = ["ModuleRegistry", "TagRecord", "UnknownModule", "builtin_id"]


class UnknownModule(LookupError):
    """A module id or tag that names nothing."""


def builtin_id(name: str) -> str:
    return hashlib.sha256(f"tokenwire-builtin:{name}".encode()).hexdigest()


@dataclass
class TagRecord:
    tag: str
    module_id: str
    updated_at: int
    updated_by: str
    wasm_size: int
    compiled_size: int


@dataclass
class Builtin:
    factory: Factory
    self_timed: bool  # enforces its own deadlines (QuickJS / wasmtime)


def _jsctrl_factory(
    env: TokenizerEnv, variables: Variables, limits: ControllerLimits, arg: str
) -> Controller:
    try:
        # local: jsctrl needs quickjs; a build without it still serves the other controllers
        from tokenwire.protocols.aici.jsctrl import JsController
    except ImportError as e:
        raise ControllerError(f"jsctrl is not available in this build: {e}") from e
    return JsController(env, variables, limits, arg)


def _decl(llguidance_tag: bool = False) -> Factory:
    def make(env: TokenizerEnv, variables: Variables, limits: ControllerLimits, arg: str) -> Controller:
        return DeclarativeController(env, variables, limits, arg, llguidance_tag=llguidance_tag)

    return make


def _wrap(key: str) -> Factory:
    """A declarative shortcut tag: the module_arg is the bare regex / schema / grammar."""

    def make(env: TokenizerEnv, variables: Variables, limits: ControllerLimits, arg: str) -> Controller:
        value: Any = arg
        if key == "json_schema":
            try:
                value = json.loads(arg)
            except json.JSONDecodeError as e:
                raise ControllerError(f"module_arg is not a JSON schema: {e}") from e
        return DeclarativeController(env, variables, limits, {key: value})

    return make


BUILTINS: dict[str, Builtin] = {
    "jsctrl": Builtin(_jsctrl_factory, True),
    "llguidance": Builtin(_decl(llguidance_tag=True), False),
    "declctrl": Builtin(_decl(), False),
    "regex": Builtin(_wrap("regex"), False),
    "json_schema": Builtin(_wrap("json_schema"), False),
    "lark": Builtin(_wrap("lark"), False),
}
BUILTIN_TAGS = {"jsctrl-latest": "jsctrl", **{name: name for name in BUILTINS if name != "jsctrl"}}


class ModuleRegistry:
    def __init__(self, store_dir: Path | None) -> None:
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self._lock = threading.Lock()
        self._builtin_by_id = {builtin_id(name): name for name in BUILTINS}
        self._compiled: dict[str, Any] = {}  # module id -> compiled wasmtime Module
        self._sizes: dict[str, tuple[int, int]] = {}
        self.tags: dict[str, TagRecord] = {}
        if self.store_dir is not None:
            (self.store_dir / "modules").mkdir(parents=True, exist_ok=True)
            self._load_tags()
        for tag, name in BUILTIN_TAGS.items():
            self.tags.setdefault(tag, TagRecord(tag, builtin_id(name), 0, "builtin", 0, 0))

    # ---- modules ---------------------------------------------------------------------------

    def mk_module(self, binary_b64: str) -> dict[str, Any]:
        try:
            wasm = base64.b64decode(binary_b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"'binary' is not valid base64: {e}") from e
        return self.add_wasm(wasm)

    def add_wasm(self, wasm: bytes) -> dict[str, Any]:
        if not wasm.startswith(WASM_MAGIC):
            raise ValueError("not a WebAssembly module (missing the \\0asm header)")
        module_id = hashlib.sha256(wasm).hexdigest()
        t0 = time.monotonic()
        compiled = _compile_wasm(wasm)
        elapsed_ms = int((time.monotonic() - t0) * 1000)
        compiled_size = _compiled_size(compiled)
        with self._lock:
            self._compiled[module_id] = compiled
            self._sizes[module_id] = (len(wasm), compiled_size)
            if self.store_dir is not None:
                path = self.store_dir / "modules" / f"{module_id}.wasm"
                if not path.exists():
                    _atomic_write(path, wasm)
        return {
            "module_id": module_id,
            "wasm_size": len(wasm),
            "compiled_size": compiled_size,
            "time": elapsed_ms,
        }

    def resolve(self, name: str) -> tuple[str, Factory, bool]:
        """module id or tag -> (module id, factory, self_timed); UnknownModule if none."""
        with self._lock:
            record = self.tags.get(name)
        module_id = record.module_id if record is not None else name
        if module_id in self._builtin_by_id:
            builtin = BUILTINS[self._builtin_by_id[module_id]]
            return module_id, builtin.factory, builtin.self_timed
        if not _HEX64.match(module_id):
            raise UnknownModule(f"unknown module or tag {name!r}")
        compiled = self._compiled_module(module_id)
        if compiled is None:
            raise UnknownModule(f"unknown module {module_id!r} (never uploaded with mk_module)")

        def make(env: TokenizerEnv, variables: Variables, limits: ControllerLimits, arg: str) -> Controller:
            # local: wasmtime; a build without it still serves the other controllers (see _jsctrl_factory)
            from tokenwire.protocols.aici.wasm import WasmController

            return WasmController(env, variables, limits, compiled, arg)

        return module_id, make, True

    def _compiled_module(self, module_id: str) -> Any:
        with self._lock:
            if module_id in self._compiled:
                return self._compiled[module_id]
        # only a module id (sha256 hex) names a file: found by the fuzzer, a 200-digit id
        # raised OSError "File name too long", and "../x" would have left the store
        if self.store_dir is None or not _HEX64.match(module_id):
            return None
        path = self.store_dir / "modules" / f"{module_id}.wasm"
        if not path.is_file():
            return None
        wasm = path.read_bytes()
        compiled = _compile_wasm(wasm)
        with self._lock:
            self._compiled[module_id] = compiled
            self._sizes[module_id] = (len(wasm), _compiled_size(compiled))
        return compiled

    def known(self, module_id: str) -> bool:
        return module_id in self._builtin_by_id or self._compiled_module(module_id) is not None

    # ---- tags ------------------------------------------------------------------------------

    def set_tags(self, module_id: str, tags: list[str], user: str) -> list[dict[str, Any]]:
        if not self.known(module_id):
            raise UnknownModule(f"unknown module {module_id!r}")
        bad = [t for t in tags if not isinstance(t, str) or not _TAG.match(t)]
        if bad or not tags:
            raise ValueError(f"invalid tags {bad or tags!r}: use 1-128 of [A-Za-z0-9_.-]")
        wasm_size, compiled_size = self._sizes.get(module_id, (0, 0))
        now = int(time.time())
        records = [TagRecord(t, module_id, now, user, wasm_size, compiled_size) for t in tags]
        with self._lock:
            for r in records:
                self.tags[r.tag] = r
            self._save_tags()
        return [asdict(r) for r in records]

    def get_tags(self) -> list[dict[str, Any]]:
        with self._lock:
            records = sorted(self.tags.values(), key=lambda r: (-r.updated_at, r.tag))
        return [asdict(r) for r in records]

    def _load_tags(self) -> None:
        assert self.store_dir is not None
        path = self.store_dir / "tags.json"
        if not path.is_file():
            return
        try:
            for item in json.loads(path.read_text()):
                record = TagRecord(**item)
                self.tags[record.tag] = record
        except (ValueError, TypeError) as e:
            raise ValueError(f"corrupt tag store {path}: {e}") from e

    def _save_tags(self) -> None:
        if self.store_dir is None:
            return
        persisted = [asdict(r) for r in self.tags.values() if r.updated_by != "builtin"]
        _atomic_write(self.store_dir / "tags.json", json.dumps(persisted, indent=1).encode())


def _compile_wasm(wasm: bytes) -> Any:
    """A wasmtime Module (via the Wasm controller's engine when it is built in)."""
    try:
        # local: the Wasm controller is optional (see _jsctrl_factory)
        from tokenwire.protocols.aici.wasm import compile_wasm
    except ImportError:
        # local: without it, plain wasmtime still checks the module
        import wasmtime

        try:
            return wasmtime.Module(wasmtime.Engine(), wasm)
        except wasmtime.WasmtimeError as e:
            raise ValueError(f"invalid Wasm module: {e}") from e
    try:
        compiled = compile_wasm(wasm)
    except Exception as e:
        raise ValueError(f"invalid Wasm module: {e}") from e
    return compiled[0] if isinstance(compiled, tuple) else compiled  # (Module, compiled size)


def _compiled_size(compiled: Any) -> int:
    try:
        return len(compiled.serialize())
    except Exception:  # not a wasmtime Module (or not serializable): size unknown
        return 0


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
