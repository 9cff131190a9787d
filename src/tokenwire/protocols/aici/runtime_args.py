"""The runtime's flags (`tokenwire aicirt`, aicirt's own set): read by the runtime (aicirt.py)
and added to the command line (plugin.py) without loading the runtime."""

from __future__ import annotations

import argparse
from pathlib import Path

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


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default="default",
        help="'default' (SmolLM2), a served model name, a model dir, .gguf or tokenizer.json",
    )
    p.add_argument("--json-size", type=int, default=128, help="MiB of each JSON channel (engine-created)")
    p.add_argument("--bin-size", type=int, default=128, help="MiB of the bias region (engine-created)")
    p.add_argument("--name", default="/aici0-", help="shared memory prefix (default %(default)s)")
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
        "--max-runtime-mb",
        type=float,
        default=4096.0,
        help="resident memory of the whole runtime past which new controllers are refused (0 = none)",
    )
    p.add_argument("--max-forks", type=int, default=64, help="forks one pre_process may ask for")
    p.add_argument("--max-ff-tokens", type=int, default=8192, help="tokens one callback may fast-forward")
    p.add_argument("--max-log-kb", type=float, default=256.0, help="log text a controller holds per step")
    p.add_argument(
        "--max-var-kb", type=float, default=4096.0, help="shared variables of one run (and writes per step)"
    )
    p.add_argument(
        "--max-host-input-kb", type=float, default=1024.0, help="text or grammar one host call takes"
    )
    p.add_argument("--max-wasm-table", type=int, default=65536, help="table elements of a Wasm controller")
    p.add_argument(
        "--busy-wait-time",
        type=float,
        default=200.0,
        help="ms to spin for the next main-channel command before sleeping (AICI's default; "
        "0 when the engine computes on the same CPU cores)",
    )
    p.add_argument("--side-workers", type=int, default=2, help="threads serving the side channel")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="exit when the process that started this runtime is gone (tokenwire's engines pass it)",
    )
    for flag in _CAPABILITY_FLAGS:
        p.add_argument(flag, nargs="?", const="1", default=None, help=argparse.SUPPRESS)
