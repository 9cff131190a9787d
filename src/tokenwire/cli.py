"""The `tokenwire` command: serve, generate, bench, concepts, and one subcommand per protocol tool.

Protocol packages and benchmarks contribute their own subcommands: each module listed in
COMMAND_MODULES (top level) or BENCH_MODULES (under `tokenwire bench`) has a
`register(sub)` that adds its parser and sets `handler=fn(args) -> int` as a default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from tokenwire.engine.factory import EngineSettings

COMMAND_MODULES = [
    "tokenwire.protocols.salience.cli",
    "tokenwire.protocols.lmtp.cli",
    "tokenwire.protocols.evergreen.cli",
    "tokenwire.protocols.graphpipe.cli",
    "tokenwire.protocols.aici.aicirt",
]
BENCH_MODULES = [
    "tokenwire.bench.salience_bench",
    "tokenwire.bench.engine_bench",
    "tokenwire.bench.graphpipe_bench",
    "tokenwire.bench.lmtp_bench",
    "tokenwire.bench.evergreen_bench",
    "tokenwire.bench.aici_bench",
    "tokenwire.bench.openai_bench",
]


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--model-name", help="name the protocols report and accept (default: file/dir name)")
    g.add_argument(
        "--cache-dir", type=Path, help="where converted GGUF weights are cached (~/.cache/tokenwire)"
    )
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    g.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "gguf", "fp32", "bf16", "int8", "int4"],
        help="weight format: auto = a GGUF's own quantisation on the CPU (else --dtype); gguf = the "
        "file's Q4_0/Q4_1/Q8_0 blocks as they are; int8/int4 = quantise at load (Q8_0/Q4_1)",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run decode steps through the eager PyTorch layers instead of the fused C++ kernels",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--kv-cache-mb", type=float, help="KV cache budget in MiB (default: from free memory)")
    g.add_argument("--max-model-len", type=int, help="cap the context length below the model's")
    g.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per model step")
    g.add_argument("--concepts", type=Path, help="concept vectors (safetensors) for readouts")
    g.add_argument("--threads", type=int, help="torch CPU threads")


def settings_from(args: argparse.Namespace, **extra: object) -> EngineSettings:
    return EngineSettings(
        model=args.model,
        model_name=args.model_name,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        device=args.device,
        kv_cache_mb=args.kv_cache_mb,
        max_model_len=args.max_model_len,
        max_batch_tokens=args.max_batch_tokens,
        concepts=args.concepts,
        threads=args.threads,
        weights=args.weights,
        compile=args.compile,
        **extra,  # type: ignore[arg-type]
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--regex", help="constrain the output to this regular expression")
    g.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text or @file)")
    g.add_argument("--lark", help="constrain the output to this Lark grammar (text or @file)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenwire", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="load the model and serve the protocols")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--session-ttl", type=float, default=1800.0, help="idle session lifetime, seconds")
    from tokenwire.server import add_serve_args

    add_serve_args(serve)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    gen.add_argument("--json", action="store_true", help="one JSON event per line")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for module in BENCH_MODULES:
        importlib.import_module(module).register(bench_sub)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)

    concepts = sub.add_parser("concepts", help="concept vectors for readouts")
    csub = concepts.add_subparsers(dest="concepts_command", required=True)
    build = csub.add_parser("build", help="difference of mean activations of two prompt files")
    add_model_args(build)
    build.add_argument("--name", required=True, help="concept name")
    build.add_argument(
        "--positive", type=Path, required=True, help="prompts showing the concept, one per line"
    )
    build.add_argument("--negative", type=Path, required=True, help="contrasting prompts, one per line")
    build.add_argument("--layers", help="comma-separated layers (default: all); 0 = embeddings")
    build.add_argument("--merge", type=Path, help="add the concept to this existing concept file")
    build.add_argument("-o", "--output", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "serve":
            from tokenwire.server import serve

            return serve(args, settings_from(args, session_ttl_s=args.session_ttl))
        if args.command == "generate":
            from tokenwire.generate_cmd import run_generate

            return run_generate(args, settings_from(args))
        handler = getattr(args, "handler", None)
        if handler is not None:
            return int(handler(args))
        if args.command == "concepts":
            from tokenwire.concepts_cmd import run_concepts_build

            return run_concepts_build(args, settings_from(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenwire: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
