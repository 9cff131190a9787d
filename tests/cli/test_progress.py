"""The start-up progress bar: one tqdm bar over every stage when stderr is a terminal (a pty
here), nothing drawn for a pipe or a file, where the log lines are the progress."""

from __future__ import annotations

import io
import os
import select

from tokenwire.progress import StartupProgress


def test_no_bar_when_the_stream_is_not_a_terminal() -> None:
    stream = io.StringIO()
    with StartupProgress(["model files", "load + warm-up"], stream=stream) as bar:
        assert not bar.enabled
        with bar.stage("model files"):
            pass
        with bar.stage("load + warm-up"):
            pass
    assert stream.getvalue() == ""
    assert [name for name, _ in bar.done] == ["model files", "load + warm-up"]


def test_one_bar_over_every_stage_on_a_terminal() -> None:
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert tty.isatty()
            with StartupProgress(["model files", "load + warm-up"], stream=tty) as bar:
                assert bar.enabled
                with bar.stage("model files"):
                    pass
                with bar.stage("load + warm-up"):
                    pass
            tty.flush()
        drawn = _read_all(leader).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)
    assert "model files" in drawn and "load + warm-up" in drawn and "2/2" in drawn, drawn


def _read_all(fd: int) -> bytes:
    """Everything written to the terminal: one read of a pty may return only part of it."""
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        out += os.read(fd, 65536)
    return out


def test_disabled_explicitly_even_on_a_terminal() -> None:
    leader, follower = os.openpty()
    try:
        with (
            os.fdopen(follower, "w", closefd=False) as tty,
            StartupProgress(["a"], stream=tty, enabled=False) as bar,
        ):
            assert not bar.enabled
    finally:
        os.close(leader)
        os.close(follower)
