"""The `tokenwire` command: serve, generate, bench, concepts, and each protocol's client or tool.

Protocols are listed in tokenwire/plugins.py, benchmarks in benchmarks() here. Every subcommand sets a
`handler(args) -> exit code`; main() parses and calls it. Building the parser imports only
light modules: `serve` and `bench` add their (heavier) flags only when they are the command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

from tokenwire import plugins
from tokenwire.cli_args import (
    HelpFormatter,
    add_model_args,
    add_sampling_args,
    settings_from,
)
from tokenwire.logs import setup_logging


def _serve(args: argparse.Namespace) -> int:
    # local: the server loads aiohttp, grpc and numpy; `tokenwire --help` does without
    from tokenwire.server import serve

    return serve(args)


def _generate(args: argparse.Namespace) -> int:
    # local: the engine (torch) loads only for `generate`
    from tokenwire.generate_cmd import run_generate

    return run_generate(args, settings_from(args))


def _concepts_build(args: argparse.Namespace) -> int:
    # local: the engine (torch) loads only for `concepts build`
    from tokenwire.concepts_cmd import run_concepts_build

    return run_concepts_build(args, settings_from(args))


def _build_serve(serve: argparse.ArgumentParser, argv: list[str]) -> None:
    # local: the server's flags need its modules (see _serve): only `serve` adds them
    from tokenwire.server import add_serve_args

    add_serve_args(serve, argv)
    serve.set_defaults(handler=_serve)


def benchmarks() -> list[ModuleType]:
    """`tokenwire bench NAME`: each module has `register(sub)`. Listed here, at the top: the
    benchmarks start the servers in-process (bench/inprocess.py), so nothing below imports them."""
    # local: the benchmarks import the engine (torch) and every protocol's client; only `bench` needs them
    from tokenwire.bench import (
        aici_bench,
        apis_bench,
        engine_bench,
        evergreen_bench,
        fuzz_bench,
        gemm_bench,
        graphpipe_bench,
        lmtp_bench,
        openai_bench,
        salience_bench,
        scale_bench,
        sessions_bench,
        soak_bench,
        spec_bench,
        vision_bench,
    )

    return [
        salience_bench, engine_bench, graphpipe_bench, lmtp_bench, evergreen_bench, aici_bench, openai_bench,
        vision_bench, scale_bench, fuzz_bench, soak_bench, spec_bench, apis_bench, sessions_bench,
        gemm_bench,
    ]  # fmt: skip


def _build_bench(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for module in benchmarks():
        module.register(bench_sub)


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv: the first argument that is neither an option of the
    top-level parser nor its value."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-format":
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    command = _command_of(argv)
    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="One LLM engine, five wire protocols: serve them, or use their clients.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="tokenwire's own DEBUG log (not other libraries')"
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log lines as text or JSON objects"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="load the model and serve every protocol", formatter_class=HelpFormatter
    )
    if command == "serve":
        _build_serve(serve, argv)

    gen = sub.add_parser(
        "generate", help="stream a completion to the terminal", formatter_class=HelpFormatter
    )
    gen.add_argument("prompt", help="the user message (with --raw: the exact text to continue)")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    gen.add_argument(
        "--image", action="append", default=[], metavar="FILE",
        help="an image (PNG/JPEG/WebP) placed before the prompt text; repeatable (vision models)",
    )  # fmt: skip
    gen.add_argument("--json", action="store_true", help="one JSON event per line")
    gen.add_argument(
        "--special", action="store_true", help="print special tokens (end of turn, BOS) as text too"
    )
    gen.set_defaults(handler=_generate)

    bench = sub.add_parser(
        "bench", help="benchmarks, each against its baseline", formatter_class=HelpFormatter
    )
    if command == "bench":
        _build_bench(bench)

    for plugin in plugins.CLI_PLUGINS:
        plugin.register_cli(sub)

    concepts = sub.add_parser("concepts", help="concept vectors for readouts", formatter_class=HelpFormatter)
    csub = concepts.add_subparsers(dest="concepts_command", required=True, metavar="ACTION")
    build = csub.add_parser(
        "build", help="difference of mean activations of two prompt files", formatter_class=HelpFormatter
    )
    add_model_args(build)
    build.add_argument("--name", required=True, help="concept name")
    build.add_argument(
        "--positive", type=Path, required=True, help="prompts showing the concept, one per line"
    )
    build.add_argument("--negative", type=Path, required=True, help="contrasting prompts, one per line")
    build.add_argument("--layers", help="comma-separated layers (default: all); 0 = embeddings")
    build.add_argument("--merge", type=Path, help="add the concept to this existing concept file")
    build.add_argument("-o", "--output", type=Path, required=True, help="the concept file to write")
    build.set_defaults(handler=_concepts_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser(argv).parse_args(argv)
    except ValueError as exc:  # a bad --config file or $TOKENWIRE_<FLAG> value
        print(f"tokenwire: error: {exc}", file=sys.stderr)
        return 2

    setup_logging(verbose=args.verbose, json_format=args.log_format == "json")
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenwire: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
