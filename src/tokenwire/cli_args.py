"""Argument groups several commands share (model, sampling) and the EngineSettings they make.

Light on purpose: building the `tokenwire` parser imports only argparse-level modules, so
`tokenwire --help` stays fast; the engine is imported when a command runs.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tokenwire.model.cache_dir import default_cache_dir
from tokenwire.model_spec import check_model_spec

# model/weight_types.py's WEIGHT_TYPES by name, written out: importing it imports torch, which
# would slow `tokenwire --help` (tests/architecture/test_readme_matches_code.py holds them equal)
GGUF_WEIGHT_TYPES = "Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL/IQ4_XS/F16/BF16/Q4_K/Q6_K/Q5_K/Q3_K/Q2_K"

if TYPE_CHECKING:
    from tokenwire.engine.factory import EngineSettings


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="a GGUF file, a Hugging Face model directory (config.json, safetensors, tokenizer), or "
        "the built-in default's name SmolLM2-135M-Instruct (default: the built-in model)",
    )
    g.add_argument("--model-name", help="name the protocols report and accept (default: the file/dir name)")
    g.add_argument(
        "--cache-dir",
        type=Path,
        help="where converted GGUF weights are cached (default: $TOKENWIRE_CACHE_DIR or ~/.cache/tokenwire)",
    )
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights and KV cache dtype")
    g.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "gguf", "fp32", "bf16", "int8", "int4"],
        help="weight format: auto = a GGUF's own quantisation on the CPU (else --dtype); gguf = the "
        f"file's blocks as they are ({GGUF_WEIGHT_TYPES}); int8/int4 = quantise at load (Q8_0/Q4_1)",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run decode steps through the eager PyTorch layers instead of the fused C++ kernels",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument(
        "--kv-cache-mb",
        type=float,
        help="KV cache budget in MiB (default: --max-num-seqs sequences of --max-model-len tokens, "
        "capped by free memory)",
    )
    g.add_argument(
        "--kv-dtype",
        default="auto",
        help="how the KV cache stores keys and values: auto, fp16 (auto's choice with quantised "
        "weights), bf16, q8 (int8 with an fp16 scale per 32), fp32 (auto's otherwise); "
        "--kv-cache-mb counts the stored bytes",
    )
    g.add_argument(
        "--speculate",
        default="ngram",
        help="ngram: guess the next tokens from the request's own context and verify them in one "
        "step (exact; off for a request that keeps missing); draft: guess them with --draft-model "
        "(its default when given); off: one token a step",
    )
    g.add_argument(
        "--draft-model",
        help="a smaller model with the same tokenizer (any form --model takes) whose greedy tokens "
        "are the guesses",
    )
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument(
        "--max-num-seqs", type=int, default=1, help="sequences the default KV budget holds at full length"
    )
    g.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per model step")
    g.add_argument("--concepts", type=Path, help="concept vectors (safetensors) for readouts")
    g.add_argument(
        "--threads",
        type=int,
        help="CPU threads of the engine's kernels (default: $TOKENWIRE_THREADS, else the CPUs in the "
        "affinity mask capped by the cgroup CPU quota; logged at start, tokenwire_engine_threads)",
    )


def settings_from(args: argparse.Namespace, **extra: object) -> EngineSettings:
    model = check_model_spec(args.model)  # before the engine's (heavy) imports: fail fast
    # local: the engine's factory imports torch; the clients' commands share these flags without it
    from tokenwire.engine.factory import EngineSettings

    return EngineSettings(
        model=model,
        model_name=args.model_name,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        device=args.device,
        kv_cache_mb=args.kv_cache_mb,
        kv_dtype=args.kv_dtype,
        speculate=args.speculate,
        draft_model=args.draft_model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        concepts=args.concepts,
        threads=args.threads,
        weights=args.weights,
        compile=args.compile,
        max_sessions=getattr(args, "max_sessions", None),  # serve's limits (docs/limits.md)
        max_queued=getattr(args, "max_queued", None),
        **extra,  # type: ignore[arg-type]
    )


def add_state_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sessions on disk (docs/sessions.md)")
    g.add_argument(
        "--state-dir",
        type=Path,
        help="where sessions and their idle KV persist, so a restart or a crash loses no conversation "
        "(default: <--cache-dir>/state)",
    )
    g.add_argument("--no-persist", dest="persist", action="store_false", help="keep sessions in memory only")
    g.add_argument(
        "--state-max-gb",
        type=float,
        help="most GiB of KV block files in --state-dir; over it whole idle sessions' KV is evicted, "
        "least recently used first (their tokens stay: the next turn computes it again); default: no bound",
    )


def state_settings(args: argparse.Namespace) -> dict[str, object]:
    """EngineSettings' state_dir and state_max_gb from serve's flags (None: --no-persist)."""
    if args.state_max_gb is not None and args.state_max_gb <= 0:
        raise ValueError(f"--state-max-gb must be > 0, got {args.state_max_gb}")
    if not args.persist:
        return {"state_dir": None, "state_max_gb": None}
    state_dir = args.state_dir
    if state_dir is None:
        state_dir = (args.cache_dir or default_cache_dir()) / "state"
    return {"state_dir": Path(state_dir).expanduser(), "state_max_gb": args.state_max_gb}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k best tokens (0 = off)")
    g.add_argument("--seed", type=int, help="same seed, same prompt: same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--regex", help="constrain the output to this regular expression")
    g.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text or @file)")
    g.add_argument("--lark", help="constrain the output to this Lark grammar (text or @file)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the help text already does or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = "%(default)" in text or "(default" in text or "default:" in text
        if shown or action.nargs == 0 or action.default in (None, [], "", argparse.SUPPRESS):
            return text  # on/off flags and flags without a default say nothing more
        return super()._get_help_string(action)


def unreachable(url: str, default_port: int) -> str | None:
    """Why a client cannot reach the server at `url` (None when a TCP connection opens): said
    before any protocol error, with the usual cause."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        with socket.create_connection((host, port), timeout=5):
            return None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return f"cannot connect to {url} ({reason}): is a server running there? Start one: `tokenwire serve`"
