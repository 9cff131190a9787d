"""The runtime child of an engine that is killed outright (no chance to stop it) exits and
removes the engine's channels from /dev/shm instead of spinning on them forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ENGINE = """
import sys, time
from tokenwire.protocols.aici.client import AiciClient
client = AiciClient(runtime_args=[f"--store-dir={sys.argv[1]}"])
print(client.proc.pid, client.prefix, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent has not reaped it yet)


def _shm_objects(prefix: str) -> list[str]:
    stem = prefix.lstrip("/")
    return [p.name for p in Path("/dev/shm").iterdir() if stem in p.name]


def test_runtime_exits_and_removes_the_channels_when_its_engine_is_killed(tmp_path: Path) -> None:
    command = [sys.executable, "-c", ENGINE, str(tmp_path)]
    engine = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        pid_text, prefix = engine.stdout.readline().split()
        runtime = int(pid_text)
        assert _running(runtime)
        assert len(_shm_objects(prefix)) == 5 + 8  # five shared memory objects, two semaphores per channel
    finally:
        engine.kill()  # SIGKILL: the engine cannot stop its runtime
        engine.wait()
    deadline = time.monotonic() + 15
    while _running(runtime) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(runtime), "the orphaned runtime is still running"
    assert _shm_objects(prefix) == []


def test_stale_channels_of_a_dead_engine_are_swept(tmp_path: Path) -> None:
    """When the runtime was killed with its engine (Ray's raylet kills a dead worker's children),
    nobody removed the channels: the next engine's start sweeps every set whose creator is gone."""
    from tokenwire.protocols.aici.shm import MessageChannel, SharedRegion, channel_names, sweep_stale_channels

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = f"/tw{int(gone.stdout)}-beef-"  # that process has exited
    live = f"/tw{os.getpid()}-cafe-"  # this one runs: its channels stay
    made = []
    for prefix in (dead, live):
        names = channel_names(prefix)
        made += [
            MessageChannel(names[role], 4096, create=True)
            for role in ("cmd", "resp", "cmd_side", "resp_side")
        ]
        made.append(SharedRegion(names["bin"], 4096, create=True))
    try:
        assert len(_shm_objects(dead)) == len(_shm_objects(live)) == 13
        assert sweep_stale_channels() >= 1
        assert _shm_objects(dead) == [] and len(_shm_objects(live)) == 13
    finally:
        for obj in made:
            obj.close()
    assert _shm_objects(live) == []
