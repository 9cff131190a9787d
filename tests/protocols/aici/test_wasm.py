"""Wasm controllers (tokenwire controller ABI v1) written in WAT, driven through the Controller
interface with the default model's tokenizer (tok_env and Simulator from test_jsctrl)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import wasmtime

from tests.protocols.aici.test_jsctrl import Simulator, deadline, make_env
from tokenwire.protocols.aici.controller import (
    ControllerError,
    ControllerLimits,
    ControllerTimeout,
    VariableStore,
)
from tokenwire.protocols.aici.wasm import WasmController, compile_wasm

PRELUDE = """
  (import "tw" "arg_len" (func $arg_len (result i32)))
  (import "tw" "arg_read" (func $arg_read (param i32 i32) (result i32)))
  (import "tw" "tokenize" (func $tokenize (param i32 i32 i32 i32) (result i32)))
  (import "tw" "set_ff_tokens" (func $set_ff (param i32 i32)))
  (import "tw" "set_num_forks" (func $set_forks (param i32)))
  (import "tw" "set_stop" (func $set_stop))
  (import "tw" "bias_disallow_all" (func $disallow_all))
  (import "tw" "bias_allow" (func $allow (param i32)))
  (import "tw" "fork_index" (func $fork_index (result i32)))
  (import "tw" "log" (func $log (param i32 i32)))
  (import "tw" "var_set" (func $var_set (param i32 i32 i32 i32 i32)))
  (memory (export "memory") 1)
  (global $heap (export "heap") (mut i32) (i32.const 4096))
  (func (export "tw_alloc") (param $n i32) (result i32)
    (local $p i32) (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $n))) (local.get $p))
  (func (export "init_prompt") (param i32 i32) (result i32) (i32.const 0))
"""


@pytest.fixture(scope="module")
def tok_env(smollm2_source):
    return make_env(smollm2_source)


def wat(body: str) -> bytes:
    return wasmtime.wat2wasm(f"(module {PRELUDE} {body})")


# forces the argument's tokens once, then stops; records a variable on the way
FORCE = wat("""
  (data (i32.const 16) "forced")
  (func (export "pre_process") (result i32) (local $n i32)
    (if (i32.load (i32.const 0)) (then (call $set_forks (i32.const 0)) (return (i32.const 0))))
    (i32.store (i32.const 0) (i32.const 1))
    (drop (call $arg_read (i32.const 256) (call $arg_len)))
    (local.set $n (call $tokenize (i32.const 256) (call $arg_len) (i32.const 1024) (i32.const 256)))
    (call $var_set (i32.const 16) (i32.const 6) (i32.const 256) (call $arg_len) (i32.const 0))
    (call $set_ff (i32.const 1024) (local.get $n)) (i32.const 0))
  (func (export "mid_process") (result i32) (i32.const 0))
  (func (export "post_process") (param i32 i32 i32) (result i32) (i32.const 0))
""")

# allows only the tokens of "0123456789" (digits), stops after 3 generated tokens
DIGITS = wat("""
  (data (i32.const 64) "0123456789")
  (data (i32.const 80) "mask")
  (func (export "pre_process") (result i32) (i32.const 0))
  (func (export "mid_process") (result i32) (local $n i32) (local $i i32)
    (local.set $n (call $tokenize (i32.const 64) (i32.const 10) (i32.const 1024) (i32.const 64)))
    (call $disallow_all)
    (loop $l (if (i32.lt_u (local.get $i) (local.get $n)) (then
      (call $allow (i32.load (i32.add (i32.const 1024) (i32.shl (local.get $i) (i32.const 2)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1))) (br $l))))
    (call $log (i32.const 80) (i32.const 4)) (i32.const 0))
  (func (export "post_process") (param i32 i32 i32) (result i32)
    (i32.store (i32.const 4) (i32.add (i32.load (i32.const 4)) (local.get 2)))
    (if (i32.ge_u (i32.load (i32.const 4)) (i32.const 3)) (then (call $set_stop))) (i32.const 0))
""")

LOOP = wat("""
  (func (export "pre_process") (result i32) (i32.const 0))
  (func (export "mid_process") (result i32) (loop $l (br $l)) (i32.const 0))
  (func (export "post_process") (param i32 i32 i32) (result i32) (i32.const 0))
""")

GROW = wat("""
  (func (export "pre_process") (result i32) (i32.const 0))
  (func (export "mid_process") (result i32)
    (loop $l (if (i32.ne (memory.grow (i32.const 16)) (i32.const -1)) (then (br $l))))
    unreachable)
  (func (export "post_process") (param i32 i32 i32) (result i32) (i32.const 0))
""")

# forks in two at the first pre_process; each fork counts its own tokens in memory and the heap
COUNTER = wat("""
  (data (i32.const 80) "fork")
  (func (export "pre_process") (result i32)
    (if (i32.eqz (i32.load (i32.const 0))) (then
      (i32.store (i32.const 0) (i32.const 1)) (call $set_forks (i32.const 2)))) (i32.const 0))
  (func (export "mid_process") (result i32)
    (call $disallow_all) (call $allow (i32.add (i32.const 100) (call $fork_index))) (i32.const 0))
  (func (export "post_process") (param i32 i32 i32) (result i32)
    (i32.store (i32.const 4) (i32.add (i32.load (i32.const 4)) (i32.const 1)))
    (if (i32.ge_u (i32.load (i32.const 4)) (i32.const 3)) (then (call $set_stop))) (i32.const 0))
""")


def controller(env, binary: bytes, arg: str = "", variables=None, **limits) -> WasmController:
    module, size = compile_wasm(binary)
    assert size > 0
    return WasmController(env, variables or VariableStore(), ControllerLimits(**limits), module, arg)


def test_forcing_controller(tok_env):
    variables = VariableStore()
    c = controller(tok_env, FORCE, "Hello from Wasm", variables)
    assert c.init_prompt([1], deadline()) == [1]
    pre = c.pre_process(deadline())
    assert pre.ff_tokens == tok_env.tokenize("Hello from Wasm") and pre.num_forks == 1
    assert variables.get("forced") == b"Hello from Wasm" and c.storage[0]["WriteVar"]["name"] == "forced"
    assert c.pre_process(deadline()).num_forks == 0


def test_masking_controller(tok_env):
    sim = Simulator(tok_env)
    s = sim.start(controller(tok_env, DIGITS), [1])
    sim.run(10)
    assert s.error is None and s.done
    assert re.fullmatch(r"\d{3}", s.text(tok_env)), s.text(tok_env)
    assert "".join(s.logs).count("mask") == 3


def test_masking_bias_shape(tok_env):
    c = controller(tok_env, DIGITS)
    c.init_prompt([1], deadline())
    bias = c.mid_process(deadline()).bias
    assert bias.dtype == np.float32 and bias.shape == (tok_env.vocab_size,)
    assert sorted(np.flatnonzero(bias == 0).tolist()) == sorted(set(tok_env.tokenize("0123456789")))


def test_loop_stops_on_fuel(tok_env):
    c = controller(tok_env, LOOP, wasm_fuel=1_000_000)
    with pytest.raises(ControllerTimeout, match="fuel"):
        c.mid_process(deadline(5))
    assert "fuel" in "".join(c.logs)
    with pytest.raises(ControllerError):
        c.pre_process(deadline())  # a failed controller stays failed


def test_loop_stops_on_epoch_deadline(tok_env):
    c = controller(tok_env, LOOP, wasm_fuel=10**15)  # fuel for days: only the epoch can stop it
    with pytest.raises(ControllerTimeout, match="deadline"):
        c.mid_process(deadline(0.05))


def test_memory_growth_stops_at_the_limit(tok_env):
    limit = 4 * 2**20
    c = controller(tok_env, GROW, memory_bytes=limit)
    with pytest.raises(ControllerError, match="trapped"):
        c.mid_process(deadline())
    assert c._memory.data_len(c._store) <= limit
    ok = controller(tok_env, DIGITS)  # the process is fine
    ok.init_prompt([1], deadline())
    assert ok.mid_process(deadline()).bias is not None


def test_clone_is_independent(tok_env):
    sim = Simulator(tok_env)
    root = sim.start(controller(tok_env, COUNTER), [1])
    sim.run(10)
    assert len(sim.seqs) == 2 and all(s.done and s.error is None for s in sim.seqs)
    assert root.tokens[1:] == [100, 100, 100] and sim.seqs[1].tokens[1:] == [101, 101, 101]
    a, b = (s.ctrl for s in sim.seqs)
    assert a._memory.read(a._store, 4, 8) == b._memory.read(b._store, 4, 8) == (3).to_bytes(4, "little")


@pytest.mark.parametrize(
    "binary, message",
    [
        (b"not wasm", "invalid module"),
        (wasmtime.wat2wasm('(module (memory (export "memory") 1))'), "does not export"),
        (wasmtime.wat2wasm('(module (import "env" "x" (func)))'), "unknown import"),
    ],
)
def test_bad_modules_are_rejected(binary, message):
    with pytest.raises(ControllerError, match=message):
        compile_wasm(binary)
