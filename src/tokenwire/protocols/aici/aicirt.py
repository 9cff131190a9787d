"""The runtime process: `tokenwire aicirt` / `tokenwire-aicirt`, argument-compatible with aicirt.

The engine has created the channels and semaphores (PREFIX + cmd, resp, cmd-side, resp-side,
bin); this process opens them, answers the main channel on its main thread (one reply per
command) and the side channel on a small thread pool (replies carry `$rid`, in any order).
Every controller call, `instantiate` included, runs on the main thread: QuickJS contexts are
bound to the thread that made them, and SIGALRM deadlines only reach the main thread. The side
pool queues instantiate requests; the main loop serves them between main-channel commands.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from tokenwire.heap import freeze_startup_heap
from tokenwire.protocols.aici.codec import FRAME_HEADER, ProtocolError, decode_message, error_reply, fit_reply
from tokenwire.protocols.aici.controller import ControllerLimits
from tokenwire.protocols.aici.registry import ModuleRegistry
from tokenwire.protocols.aici.runtime import AiciRuntime, StopRuntime
from tokenwire.protocols.aici.runtime_args import add_runtime_args
from tokenwire.protocols.aici.shm import MessageChannel, SharedRegion, channel_names, remove_channels
from tokenwire.protocols.aici.watchdog import install as install_watchdog

log = logging.getLogger("tokenwire.aicirt")


def main(argv: list[str] | None = None) -> int:
    """Console script `tokenwire-aicirt`."""
    p = argparse.ArgumentParser(prog="tokenwire-aicirt", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    add_runtime_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run(args)


def limits_from(args: argparse.Namespace) -> ControllerLimits:
    return ControllerLimits(
        pre_s=args.max_pre_ms / 1000,
        mid_s=args.max_mid_ms / 1000,
        post_s=args.max_post_ms / 1000,
        init_s=args.max_init_ms / 1000,
        memory_bytes=int(args.max_memory_mb * 2**20),
        max_forks=args.max_forks,
        max_ff_tokens=args.max_ff_tokens,
        max_log_bytes=int(args.max_log_kb * 2**10),
        max_var_bytes=int(args.max_var_kb * 2**10),
        max_host_input=int(args.max_host_input_kb * 2**10),
        max_table_elements=args.max_wasm_table,
    )


def run(args: argparse.Namespace) -> int:
    try:
        os.setpgrp()  # the engine kills our whole process group at exit
    except OSError:
        pass  # already a group leader
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if args.exit_with_parent:
        _exit_with_parent(os.getppid(), args.name)
    # local: torch and the tokenizer take seconds to load: the process group and the parent watch
    # come first, so a runtime whose engine dies meanwhile still exits
    import torch

    # one thread: an OpenMP team here stalls ~8 ms per op whenever the CPU is shared (measured)
    torch.set_num_threads(1)
    # local: it loads torch and transformers (see above)
    from tokenwire.protocols.aici.tokenizer_env import env_for, load_tokenizer

    try:
        env = env_for(load_tokenizer(args.tokenizer))
        runtime = AiciRuntime(
            env,
            ModuleRegistry(args.store_dir),
            limits_from(args),
            tolerance_s=args.time_tolerance_ms / 1000,
            max_rss_bytes=int(args.max_runtime_mb * 2**20) if args.max_runtime_mb > 0 else None,
            watchdog=install_watchdog(),  # on this (the main) thread: every controller call runs here
        )
        names = channel_names(args.name)
        cmd = MessageChannel(names["cmd"], create=False)
        resp = MessageChannel(names["resp"], create=False)
        side_cmd = MessageChannel(names["cmd_side"], create=False)
        side_resp = MessageChannel(names["resp_side"], create=False)
        bin_region = SharedRegion(names["bin"], 0, create=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenwire-aicirt: error: {e}", file=sys.stderr)
        return 2
    freeze_startup_heap()  # a full collection here costs 225 ms of a 6 ms deadline: heap.py
    bias = np.frombuffer(bin_region.map, dtype=np.float32, count=bin_region.size // 4)
    main_queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
    threading.Thread(
        target=_serve_side,
        args=(runtime, side_cmd, side_resp, args.side_workers, main_queue),
        name="aicirt-side",
        daemon=True,
    ).start()
    log.info("aicirt serving %s (vocab %d)", args.name, env.vocab_size)
    serve_main(runtime, cmd, resp, bias, main_queue, busy_wait_s=max(0.0, args.busy_wait_time) / 1000)
    return 0


def _exit_with_parent(parent: int, prefix: str, poll_s: float = 1.0) -> None:
    """Exit once `parent` is gone (we were re-parented), removing the channels it made. The
    engine that started us kills our process group when it stops, but an engine killed outright
    (SIGKILL, the OOM killer, a Ray actor killed with its replica) cannot: its runtime would
    spin on channels nobody writes, and they would stay in /dev/shm."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("the engine (pid %d) is gone: removing its channels and exiting", parent)
        remove_channels(prefix)
        os._exit(0)

    threading.Thread(target=watch, name="aicirt-parent", daemon=True).start()


def serve_main(
    runtime: AiciRuntime,
    cmd: MessageChannel,
    resp: MessageChannel,
    bias: np.ndarray,
    main_queue: queue.SimpleQueue[Callable[[], None]],
    *,
    busy_wait_s: float = 0.0,
) -> None:
    """Serve the main channel until `stop`. For `busy_wait_s` after each reply the wait for the
    next command spins (AICI's --busy-wait-time): the engine's next command usually follows
    within one forward pass, and a spinning runtime answers it without a wake-up."""
    spin_until = 0.0
    while True:
        while True:  # side-channel work that must run on this thread
            try:
                main_queue.get_nowait()()
            except queue.Empty:
                break
        payload = cmd.recv(timeout=0.005, spin_s=spin_until - time.monotonic())
        if payload is None:
            if runtime.freed_since_trim:  # idle: hand freed controllers' memory back
                runtime.freed_since_trim = 0
                _trim_heap()
            continue
        try:
            reply = runtime.handle_main(decode_message(payload), bias)
        except ProtocolError as e:
            reply = error_reply(str(e))
        except StopRuntime:
            log.info("stop requested")
            return
        except Exception as e:  # never die on one request
            log.exception("main channel request failed")
            reply = error_reply(f"internal error: {type(e).__name__}: {e}")
        resp.send(fit_reply(reply, resp.region.size - FRAME_HEADER))
        spin_until = time.monotonic() + busy_wait_s


def _serve_side(
    runtime: AiciRuntime,
    cmd: MessageChannel,
    resp: MessageChannel,
    workers: int,
    main_queue: queue.SimpleQueue[Callable[[], None]],
) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, workers), thread_name_prefix="aicirt-side"
    )
    send_lock = threading.Lock()

    def answer(payload: bytes, on_main: bool = False) -> None:
        try:
            msg = decode_message(payload)
            if msg.get("op") == "instantiate" and not on_main:
                main_queue.put(lambda: answer(payload, on_main=True))
                return
            reply = runtime.handle_side(msg)
        except ProtocolError as e:
            reply = error_reply(str(e), _rid_of(payload))
        except Exception as e:
            log.exception("side channel request failed")
            reply = error_reply(f"internal error: {type(e).__name__}: {e}", _rid_of(payload))
        with send_lock:
            resp.send(fit_reply(reply, resp.region.size - FRAME_HEADER))

    while True:
        payload = cmd.recv()
        if payload is not None:
            pool.submit(answer, payload)


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc keeps them: freed QuickJS contexts
    and Wasm buffers stayed resident). Costs ~1 ms; only when idle and something was freed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rid_of(payload: bytes) -> str | None:
    """Best effort: the $rid of a request that failed to parse as a whole."""
    m = re.search(rb'"\$rid"\s*:\s*"([^"\\]{1,200})"', payload)
    return m.group(1).decode() if m else None
