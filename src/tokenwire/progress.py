"""One progress bar over a command's start-up (GGUF conversion, model files, load and warm-up),
on stderr when it is a terminal; the log lines stay either way (the only progress a pipe sees).

    with StartupProgress(["model files", "load + warm-up"]) as bar:
        with bar.stage("model files"):
            ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from tqdm import tqdm


class StartupProgress:
    def __init__(self, stages: Sequence[str], *, stream: IO[str] | None = None, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.stages = list(stages)
        self.done: list[tuple[str, float]] = []  # (stage, seconds), in order
        self._bar: Any = None

    def __enter__(self) -> StartupProgress:
        if self.enabled:
            self._bar = tqdm(
                total=len(self.stages), file=self.stream, desc="starting: ", unit="step", leave=False,
                bar_format="{desc}{n_fmt}/{total_fmt} |{bar}| {elapsed}",
                mininterval=0, miniters=1,  # every stage drawn (tqdm's adaptive miniters skipped some)
            )  # fmt: skip
        return self

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self._bar is not None:
            self._bar.set_description(name)
        started = time.monotonic()
        yield
        self.done.append((name, time.monotonic() - started))
        if self._bar is not None:
            self._bar.update(1)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
