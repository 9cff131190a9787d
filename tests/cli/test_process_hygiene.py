"""Process-wide set-up the server does once: its log handler and the frozen start-up heap."""

from __future__ import annotations

import gc
import io
import logging
import sys
import weakref

from tokenwire.heap import freeze_startup_heap
from tokenwire.logs import setup_logging


def test_log_handler_follows_the_current_stderr() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, sys.stderr)
    try:
        first = io.StringIO()
        sys.stderr = first
        setup_logging()
        first.close()  # the stream that was there at set-up is gone (pytest's capture, say)
        second = io.StringIO()
        sys.stderr = second
        logging.getLogger("tokenwire.test").warning("still logged")
        assert "still logged" in second.getvalue()
    finally:
        root.handlers[:], sys.stderr = saved[0], saved[2]
        root.setLevel(saved[1])


def test_frozen_heap_still_collects_new_cycles() -> None:
    class Node:
        other: object = None

    try:
        assert freeze_startup_heap() > 10_000  # torch, the test runner: many objects exist now
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None  # objects made after the freeze are collected as before
    finally:
        gc.unfreeze()
