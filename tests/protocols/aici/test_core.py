"""The runtime core in process: Python-level deadlines (SIGALRM), tag persistence."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tokenwire.protocols.aici.controller import Controller, PostResult, PreResult
from tokenwire.protocols.aici.registry import ModuleRegistry
from tokenwire.protocols.aici.runtime import AiciRuntime
from tokenwire.protocols.aici.tokenizer_env import env_for


@pytest.fixture(scope="module")
def env(smollm2_source):
    return env_for(smollm2_source.tokenizer)


class Spinner(Controller):
    """A Python controller whose mid_process never returns on its own."""

    def init_prompt(self, prompt, deadline):
        return prompt

    def pre_process(self, deadline):
        return PreResult()

    def mid_process(self, deadline):
        while True:
            pass

    def post_process(self, backtrack, tokens, deadline):
        return PostResult()

    def clone(self, fork_index):
        return self


def _two_sequences(env, tmp_path, first: type[Controller], second=None, **runtime_kw):
    """A runtime with sequence 1 run by `first` (a Python controller) and sequence 2 by
    `second` (the same, or a regex controller): the replies of their first step,
    (pre_seqs, mid seqs, the bias rows)."""
    from tokenwire.protocols.aici.controller import VariableStore
    from tokenwire.protocols.aici.runtime import Instance

    rt = AiciRuntime(env, ModuleRegistry(tmp_path), **runtime_kw)
    rt.instances["one"] = Instance(first(env, VariableStore(), rt.limits), self_timed=False)
    if second is None:
        rt.handle_side(
            {"$rid": "1", "op": "instantiate", "req_id": "two", "module_id": "regex", "module_arg": "ab"}
        )
    else:
        rt.instances["two"] = Instance(second(env, VariableStore(), rt.limits), self_timed=False)
    pre_ops = [{"id": 1, "req_id": "one"}, {"id": 2, "req_id": "two"}]
    reply = rt.handle_main({"op": "post_pre_process", "post_ops": [], "pre_ops": pre_ops}, np.zeros(1))
    assert reply["type"] == "ok"
    bias = np.zeros(2 * env.vocab_size, dtype=np.float32)
    seqs = rt.handle_main({"op": "mid_process", "ops": [{"id": 1}, {"id": 2}]}, bias)["data"]["seqs"]
    return reply["data"]["pre_seqs"], seqs, bias


def test_python_controller_past_its_deadline_is_interrupted(env, tmp_path):
    _, seqs, bias = _two_sequences(env, tmp_path, Spinner)
    assert "time limit" in seqs["1"]["error"] and "ERROR" in seqs["1"]["logs"]
    assert seqs["2"]["error"] == ""
    row = bias[env.vocab_size :]
    assert np.isfinite(row).sum() >= 1 and not np.isfinite(row).all()
    assert (bias[: env.vocab_size] == 0).all()  # the failed sequence's row is neutral


class Collector(Spinner):
    """pre_process runs a full garbage collection over a large heap that is not its own, then
    answers; mid_process answers at once."""

    gc_cpu_s = 0.0

    def pre_process(self, deadline):
        import gc

        start = time.thread_time()
        gc.collect()
        Collector.gc_cpu_s = time.thread_time() - start
        return PreResult()

    def mid_process(self, deadline):
        from tokenwire.protocols.aici.controller import MidResult

        return MidResult(bias=np.zeros(self.env.vocab_size, dtype=np.float32))


class CollectingSpinner(Spinner):
    """A spinner that collects garbage all the time: the collections are credited, the loop is not."""

    def mid_process(self, deadline):
        import gc

        while True:
            gc.collect(0)


def _burn_cpu(seconds: float) -> None:
    """Busy for `seconds` of this thread's CPU time (what the deadlines count)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        continue


class Finalized:
    """Cyclic garbage whose finalizer (run by the collector) takes 20 ms of CPU."""

    finished = 0

    def __init__(self):
        self.cycle = self

    def __del__(self):
        _burn_cpu(0.02)
        Finalized.finished += 1


def _other_gc_hook(phase, info):
    """Another library's gc callback (hypothesis inserts one at the front), 5 ms of CPU a call."""
    _burn_cpu(0.005)


def test_garbage_collection_is_not_charged_to_the_controller_it_interrupts(env, tmp_path, monkeypatch):
    import gc
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # an exception lost in a hook
    gc.freeze()  # this worker's own objects: the collection's cost is the heap below (~0.2 s)
    heap = [[i] for i in range(1_500_000)]  # the server's objects, walked by every full collection
    gc.disable()  # the garbage below is collected inside the controller's call, not before
    gc.callbacks.insert(0, _other_gc_hook)
    try:
        Finalized()
        pre, seqs, _ = _two_sequences(env, tmp_path, Collector, Collector)
        assert Collector.gc_cpu_s > 0.006  # the collection alone took more than the whole budget
        assert Finalized.finished == 1  # the finalizer the collection ran was not interrupted
        assert pre["1"]["error"] == "" and pre["2"]["error"] == ""
        assert seqs["1"]["error"] == "" and seqs["2"]["error"] == ""
        # collections without end: each credited (the other hook's 5 ms too), 2 s at most
        _, seqs, _ = _two_sequences(env, tmp_path, CollectingSpinner)
        assert "time limit" in seqs["1"]["error"]
    finally:
        gc.callbacks.remove(_other_gc_hook)
        gc.enable()
        gc.unfreeze()
    assert unraisable == []
    del heap


def test_tags_persist_across_restarts(tmp_path):
    import wasmtime

    wasm = wasmtime.wat2wasm(
        '(module (memory (export "memory") 1)'
        ' (func (export "tw_alloc") (param i32) (result i32) (i32.const 8))'
        ' (func (export "init_prompt") (param i32 i32) (result i32) (i32.const 0))'
        ' (func (export "pre_process") (result i32) (i32.const 0))'
        ' (func (export "mid_process") (result i32) (i32.const 0))'
        ' (func (export "post_process") (param i32 i32 i32) (result i32) (i32.const 0)))'
    )
    first = ModuleRegistry(tmp_path)
    mid = first.add_wasm(wasm)["module_id"]
    first.set_tags(mid, ["persisted"], "me")
    second = ModuleRegistry(tmp_path)  # a restarted runtime
    tags = {t["tag"]: t for t in second.get_tags()}
    assert tags["persisted"]["module_id"] == mid and tags["persisted"]["updated_by"] == "me"
    assert second.resolve("persisted")[0] == mid


@pytest.mark.parametrize("vocab", [64, 61, 100])
def test_bias_rows_expand_masks_like_a_per_token_loop(vocab):
    from tokenwire.protocols.aici.bias_rows import BiasWriter
    from tokenwire.protocols.aici.controller import MidResult

    rng = np.random.default_rng(vocab)
    n_words = (vocab + 31) // 32
    masks = [rng.integers(0, 2**32, size=n_words, dtype=np.uint64).astype(np.uint32) for _ in range(3)]
    writer = BiasWriter(vocab, vocab)
    writer.begin(4)
    writer.add(0, MidResult(mask=masks[0]))
    writer.add(1, MidResult(mask=masks[1], disallow=(3, 5)))
    writer.add(2, MidResult(bias=np.arange(vocab, dtype=np.float32)))
    # row 3: nothing = neutral
    out = np.full(4 * vocab + 7, 42.0, dtype=np.float32)
    assert writer.finish(out) == {}
    rows = out[: 4 * vocab].reshape(4, vocab)
    for r in (0, 1):
        want = [
            0.0 if (int(masks[r][t // 32]) >> (t % 32)) & 1 and not (r == 1 and t in (3, 5)) else -np.inf
            for t in range(vocab)
        ]
        assert rows[r].tolist() == want
    assert rows[2].tolist() == list(range(vocab)) and (rows[3] == 0).all()
    assert (out[4 * vocab :] == 42.0).all()  # nothing written past the step's rows


class Silent(Spinner):
    """A controller whose pre_process returns nothing (a broken controller, not a protocol error)."""

    def pre_process(self, deadline):
        return None


def test_a_callback_without_a_result_fails_its_own_sequence(env, tmp_path):
    pre, seqs, _ = _two_sequences(env, tmp_path, Silent)
    assert (
        pre["1"]["error"] == "pre_process: the controller returned no result" and pre["1"]["result"] is None
    )
    assert "ERROR pre_process" in pre["1"]["logs"]
    assert pre["2"]["error"] == "" and pre["2"]["result"]["num_forks"] == 1
    assert seqs["1"]["error"] == "sequence already stopped" and seqs["2"]["error"] == ""


def test_channel_spin_is_bounded_by_the_timeout_and_sees_messages():
    import threading

    from tokenwire.protocols.aici.shm import MessageChannel, pid_prefix

    ch = MessageChannel(pid_prefix("/twspin") + "c", 4096, create=True)
    try:
        t0 = time.monotonic()
        assert ch.recv(timeout=0.05, spin_s=600.0) is None
        # the timeout ends the spin: a recv that spun on would be here ten minutes later (a
        # hang guard 60x the 0.05 s waited, not a speed claim)
        assert time.monotonic() - t0 < 30
        threading.Timer(0.02, lambda: ch.send(b'{"op":"ping"}')).start()
        assert ch.recv(timeout=5.0, spin_s=1.0) == b'{"op":"ping"}'  # arrives while spinning
        threading.Timer(0.1, lambda: ch.send(b"late")).start()
        assert ch.recv(timeout=5.0, spin_s=0.01) == b"late"  # after the spin: a blocking wait
    finally:
        ch.close()


def test_grammars_of_fork_branches_compile_at_instantiate(env, tmp_path):
    rt = AiciRuntime(env, ModuleRegistry(tmp_path))
    good = {"steps": [{"fork": [[{"gen": {"regex": "[ab]"}}], [{"gen": {"regex": "[cd]"}}]]}]}
    bad = {"steps": [{"fork": [[{"fixed": "x"}], [{"gen": {"regex": "(unclosed"}}]]}]}
    ok = rt.handle_side(
        {"$rid": "1", "op": "instantiate", "req_id": "g", "module_id": "declctrl", "module_arg": good}
    )
    assert ok["type"] == "ok" and ok["data"]["error"] == ""
    ctrl = rt.instances["g"].controller
    assert len(ctrl._templates) == 2  # both branches' grammars, before any step ran
    failed = rt.handle_side(
        {"$rid": "2", "op": "instantiate", "req_id": "b", "module_id": "declctrl", "module_arg": bad}
    )
    assert failed["type"] == "ok" and "bad grammar" in failed["data"]["error"], failed
    assert "b" not in rt.instances


class Descheduled(Spinner):
    """pre_process takes 30 ms of wall time but almost no CPU time: what a controller sees when
    the model's forward pass holds every core and the runtime is preempted."""

    def pre_process(self, deadline):
        time.sleep(0.03)
        return PreResult()

    def mid_process(self, deadline):
        from tokenwire.protocols.aici.controller import MidResult

        return MidResult()


def test_time_limits_count_cpu_time_not_preemption(env, tmp_path):
    pre, seqs, _ = _two_sequences(env, tmp_path, Descheduled, Spinner, tolerance_s=0.001)  # pre: 2 ms
    assert pre["1"]["error"] == "" and pre["1"]["micros"] >= 30_000  # slow on the clock, not on the CPU
    assert "time limit" in seqs["2"]["error"]  # burning CPU still is not
    assert seqs["1"]["error"] == ""
