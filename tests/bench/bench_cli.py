"""Running `tokenwire bench NAME --json ...` in a child process, as a user does, for the bench
tests: its exit status must be 0 and its standard output the JSON result."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def bench_json(name: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tokenwire.cli", "bench", name, "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)
