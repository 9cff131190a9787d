"""A `tokenwire serve` child process in tests: wait until it is ready, stop it with SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time


def wait_ready(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    """The server's log up to its "tokenwire ready" line (AssertionError if it never comes)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "tokenwire ready" in line:
            return "".join(lines)
    raise AssertionError("server did not become ready:\n" + "".join(lines))


def stop_cleanly(proc: subprocess.Popen[str]) -> None:
    """SIGTERM: the server exits 0 and says it stopped."""
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    assert "stopped" in rest


def kill_if_running(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
