"""The memory a model's load takes: build_engine in a fresh process, then its peak RSS.

`bench engine` runs this module (-m) after its own measures, with the engine's settings pickled
on stdin; it prints one JSON line: the seconds build_engine took (a warm start by then: the
file's first-start conversion is cached), the process's RSS before the load (interpreter, torch,
tokenwire imported) and its peak (VmHWM) after it, and the KV cache the engine chose.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tokenwire.engine.factory import EngineSettings, build_engine


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def probe(settings: EngineSettings, timeout: float = 1800) -> dict[str, Any]:
    """Runs the probe in a child process; its JSON."""
    out = subprocess.run(
        [sys.executable, "-m", __name__], input=pickle.dumps(settings), capture_output=True, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"load probe failed: {out.stderr.decode(errors='replace')[-2000:]}")
    return dict(json.loads(out.stdout.decode().strip().splitlines()[-1]))


def _child() -> None:
    settings: EngineSettings = pickle.loads(sys.stdin.buffer.read())
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    engine = build_engine(settings)
    load_s = time.perf_counter() - started
    peak = _status_mb("VmHWM")
    kv_mb = engine.kv_cache_mb
    engine.shutdown()
    result = {"load_s": load_s, "rss_before_mb": before, "peak_rss_mb": peak, "kv_cache_mb": kv_mb}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    _child()
