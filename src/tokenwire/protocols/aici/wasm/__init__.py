"""Wasm controllers: tokenwire's controller ABI (abi.py) run in wasmtime (controller.py)."""

from tokenwire.protocols.aici.wasm.controller import WasmController, compile_wasm

__all__ = ["WasmController", "compile_wasm"]
