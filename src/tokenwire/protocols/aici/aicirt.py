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
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenwire.protocols.aici.codec import ProtocolError, decode_message, encode_message, error_reply
from tokenwire.protocols.aici.controller import ControllerLimits
from tokenwire.protocols.aici.registry import ModuleRegistry
from tokenwire.protocols.aici.runtime import AiciRuntime, StopRuntime
from tokenwire.protocols.aici.shm import DEFAULT_PREFIX, MessageChannel, SharedRegion, channel_names

log = logging.getLogger("tokenwire.aicirt")

# flags later AICI engines pass; accepted so any of them can start this runtime
_CAPABILITY_FLAGS = [
    "--futex",
    "--restricted",
    "--wasm-timer-resolution-us",
    "--wasm-max-memory",
    "--wasm-max-pre-step-time",
    "--wasm-max-step-time",
    "--wasm-max-init-time",
    "--wasm-max-timeout-steps",
    "--cap-backtrack",
    "--cap-ff-tokens",
    "--cap-fork",
    "--shm-prefix",
    "--module-upload",
    "--bench",
    "--save-tokenizer",
    "--add-tokens",
    "--json-size-mb",
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default="default",
        help="'default' (SmolLM2), a served model name, a model dir, .gguf or tokenizer.json",
    )
    p.add_argument("--json-size", type=int, default=128, help="MiB of each JSON channel (engine-created)")
    p.add_argument("--bin-size", type=int, default=128, help="MiB of the bias region (engine-created)")
    p.add_argument("--name", default=DEFAULT_PREFIX, help="shared memory prefix (default %(default)s)")
    p.add_argument("--server", action="store_true", help="serve the channels (aicirt compatibility)")
    p.add_argument(
        "--store-dir",
        type=Path,
        default=Path.home() / ".cache" / "tokenwire" / "aici",
        help="where uploaded modules and tags persist (default %(default)s)",
    )
    p.add_argument("--max-pre-ms", type=float, default=1.0, help="pre_process time limit")
    p.add_argument("--max-post-ms", type=float, default=1.0, help="post_process time limit")
    p.add_argument("--max-mid-ms", type=float, default=20.0, help="mid_process time limit")
    p.add_argument("--max-init-ms", type=float, default=1000.0, help="instantiate time limit")
    p.add_argument(
        "--time-tolerance-ms",
        type=float,
        default=5.0,
        help="scheduling slack added to every limit (a shared CPU preempts)",
    )
    p.add_argument("--max-memory-mb", type=float, default=64.0, help="memory per jsctrl/Wasm controller")
    p.add_argument(
        "--busy-wait-time",
        type=float,
        default=200.0,
        help="ms to spin for the next main-channel command before sleeping (AICI's default; "
        "0 when the engine computes on the same CPU cores)",
    )
    p.add_argument("--side-workers", type=int, default=2, help="threads serving the side channel")
    for flag in _CAPABILITY_FLAGS:
        p.add_argument(flag, nargs="?", const="1", default=None, help=argparse.SUPPRESS)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("aicirt", help="AICI controller runtime over shared memory (started by the engine)")
    add_args(p)
    p.set_defaults(handler=run)


def main(argv: list[str] | None = None) -> int:
    """Console script `tokenwire-aicirt`."""
    p = argparse.ArgumentParser(prog="tokenwire-aicirt", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    add_args(p)
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
    )


def run(args: argparse.Namespace) -> int:
    try:
        os.setpgrp()  # the engine kills our whole process group at exit
    except OSError:
        pass  # already a group leader
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    import torch

    # one thread: an OpenMP team here stalls ~8 ms per op whenever the CPU is shared (measured)
    torch.set_num_threads(1)
    from tokenwire.protocols.aici.tokenizer_env import env_for, load_tokenizer

    try:
        env = env_for(load_tokenizer(args.tokenizer))
        runtime = AiciRuntime(
            env, ModuleRegistry(args.store_dir), limits_from(args), tolerance_s=args.time_tolerance_ms / 1000
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
        resp.send(encode_message(reply))
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
            resp.send(encode_message(reply))

    while True:
        payload = cmd.recv()
        if payload is not None:
            pool.submit(answer, payload)


def _rid_of(payload: bytes) -> str | None:
    """Best effort: the $rid of a request that failed to parse as a whole."""
    import re

    m = re.search(rb'"\$rid"\s*:\s*"([^"\\]{1,200})"', payload)
    return m.group(1).decode() if m else None
