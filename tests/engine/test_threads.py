"""The engine's thread count follows the CPUs this process may use (affinity mask, cgroup v2
quota) unless --threads or $TOKENWIRE_THREADS says otherwise; the choice is logged and exported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tokenwire.engine import threads
from tokenwire.engine.threads import ENV, cgroup_cpu_limit, choose_threads

CHILD = (
    "import torch; from tokenwire.engine.threads import apply_threads; import sys;"
    "c = apply_threads(int(sys.argv[1]) or None); print(c.threads, c.source, torch.get_num_threads())"
)
needs_taskset = pytest.mark.skipif(
    shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="needs taskset and 2 CPUs"
)


def _child(requested: int, env: dict[str, str]) -> list[str]:
    """apply_threads in a child pinned to CPU 0 alone: its threads, source, torch's count."""
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", CHILD, str(requested)],
        capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != ENV}, **env},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@needs_taskset
def test_a_narrow_affinity_mask_sets_the_thread_count() -> None:
    assert _child(0, {}) == ["1", "affinity", "1"]


@needs_taskset
def test_the_flag_and_the_environment_override_the_mask() -> None:
    assert _child(2, {ENV: "3"}) == ["2", "flag", "2"]  # flag > environment
    assert _child(0, {ENV: "2"}) == ["2", "env", "2"]


def test_a_bad_environment_value_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=ENV):
        choose_threads()


def _cgroup(tmp_path, limits: dict[str, str]):
    for rel, value in limits.items():
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/a/b\n")
    return tmp_path, proc


def test_the_tightest_cgroup_quota_on_the_path_counts(tmp_path) -> None:
    root, proc = _cgroup(tmp_path, {"a": "50000 100000", "a/b": "150000 100000"})
    assert cgroup_cpu_limit(root, proc) == 0.5
    root, proc = _cgroup(tmp_path, {"a": "max 100000", "a/b": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None


def test_a_quota_below_the_mask_rounds_up(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1.5)
    choice = choose_threads()
    assert (choice.threads, choice.source) == (2, "cgroup")
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 16.0)
    assert (choose_threads().threads, choose_threads().source) == (8, "affinity")


def test_the_choice_is_logged_and_exported(monkeypatch, caplog) -> None:
    import torch

    from tokenwire.metrics import EngineCollector

    before = torch.get_num_threads()
    monkeypatch.setenv(ENV, "1")
    try:
        with caplog.at_level("INFO", logger="tokenwire.threads"):
            threads.apply_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "engine threads: 1 ($TOKENWIRE_THREADS=1" in caplog.text
    stats = dict.fromkeys(("running", "waiting", "kv_blocks_total", "prefix_cache_hits", "sessions"), 0)
    stats.update(kv_blocks_available=0, kv_dtype="fp16", kv_tokens_total=0, kv_bytes_per_token=0)
    stats.update(spec_proposed=0, spec_accepted=0, spec_verifications=0)
    engine = SimpleNamespace(stats=lambda: stats, kv=SimpleNamespace(block_size=16))
    gauges = {m.name: m for m in EngineCollector(engine).collect()}  # type: ignore[arg-type]
    sample = gauges["tokenwire_engine_threads"].samples[0]
    assert sample.labels == {"source": "env"} and sample.value == 1
