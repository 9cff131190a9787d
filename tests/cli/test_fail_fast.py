"""Mistakes cost a second, not a model load: bad arguments and port clashes are refused first,
in one line naming the flag; `tokenwire --help` imports no ML library."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys

import pytest

from tokenwire.cli import main
from tokenwire.model_spec import BUILTIN_NAME, check_model_spec

CMD = [sys.executable, "-m", "tokenwire.cli"]
ALL_OFF = [
    *("--lmtp-port", "0", "--grpc-port", "0", "--graphpipe-port", "0", "--http-port", "0"),
    *("--metrics-port", "0"),
]


def test_help_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from tokenwire.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "heavy = ('torch', 'transformers', 'llguidance', 'numpy', 'grpc', 'aiohttp')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_help_shows_defaults() -> None:
    out = subprocess.run([*CMD, "serve", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert out.returncode == 0
    assert "(default: 50051)" in text and "(default: 9464)" in text
    assert "(default: 1800.0)" in text  # --session-ttl


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("the model was loaded")

    import tokenwire.engine.factory as factory

    monkeypatch.setattr(factory, "build_engine", refuse)
    monkeypatch.setattr("tokenwire.generate_cmd.build_engine", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--regex", "a", "--lark", "start: /a/"], "at most one of --regex, --json-schema, --lark"),
        (["--regex", "("], "invalid --regex '(': unclosed group"),
        (["--json-schema", '{"type": "objectx"}'], "invalid --json-schema"),
        (["--json-schema", "{oops"], "--json-schema: not valid JSON"),
        (["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"], "tokenwire never downloads models"),
        (["--model", "/nowhere/model.gguf"], "--model accepts a .gguf file"),
    ],
)
def test_generate_refuses_bad_arguments_before_loading(no_model_load, capsys, argv, message) -> None:
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err  # one line
    assert "start: /(/" not in err  # not llguidance's internal grammar


def test_the_builtin_name_is_a_model() -> None:
    assert check_model_spec(BUILTIN_NAME) is None and check_model_spec(None) is None


def _listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


PORT_FLAGS = ["--lmtp-port", "--grpc-port", "--graphpipe-port", "--http-port", "--metrics-port"]

# `python -m tokenwire.cli ARGS`, then (at the interpreter's exit) which of the model load's
# modules were ever imported: the engine factory imports torch and loads the weights, so a run
# that never imported them never began a model load, however long it took on a loaded machine
LOADS_MODEL = ("tokenwire.engine.factory", "torch", "transformers")
REPORTING_CLI = (
    "import atexit, runpy, sys\n"
    f"atexit.register(lambda: print('imported:', [m for m in {LOADS_MODEL!r} if m in sys.modules]))\n"
    "runpy.run_module('tokenwire.cli', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.parametrize("flag", PORT_FLAGS)
def test_a_port_clash_exits_at_once_naming_the_flag(flag: str) -> None:
    taken = _listening()
    port = taken.getsockname()[1]
    argv = [sys.executable, "-c", REPORTING_CLI, "serve", *ALL_OFF, flag, str(port)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)  # hang guard
    finally:
        taken.close()
    assert out.returncode == 1
    assert out.stderr.strip() == f"tokenwire serve: {flag} {port}: address already in use (127.0.0.1:{port})"
    assert out.stdout.strip() == "imported: []", out.stdout  # refused before any model load


def test_the_aici_port_clash_is_refused_too() -> None:
    taken = _listening()
    port = taken.getsockname()[1]
    try:
        argv = [*CMD, "serve", *ALL_OFF, "--aici", "--aici-port", str(port)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode == 1 and f"--aici-port {port}: address already in use" in out.stderr


def test_two_grpc_servers_can_never_share_a_port() -> None:
    """grpc turns SO_REUSEPORT on by default: a second server would silently share the port
    (clients split between two servers). Ours is refused, whoever listens first."""
    import grpc

    from tokenwire.protocols.grpc_server import GrpcServer
    from tokenwire.protocols.serving import PortInUseError

    async def scenario() -> None:
        first = await GrpcServer(None, argparse.Namespace(), "127.0.0.1", 0, services=[]).bind()
        with pytest.raises(PortInUseError, match=f"--grpc-port {first.port}: address already in use"):
            await GrpcServer(None, argparse.Namespace(), "127.0.0.1", first.port, services=[]).bind()
        first.close()

    asyncio.run(scenario())
    stock = grpc.server(None)  # grpc's defaults: SO_REUSEPORT on
    port = stock.add_insecure_port("127.0.0.1:0")
    stock.start()
    try:
        out = subprocess.run(
            [*CMD, "serve", *ALL_OFF, "--grpc-port", str(port)], capture_output=True, text=True, timeout=60
        )
    finally:
        stock.stop(None)
    assert out.returncode == 1 and f"--grpc-port {port}: address already in use" in out.stderr


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        (["lmtp", "hi", "--url", "ws://127.0.0.1:{port}/"], "ws://127.0.0.1:{port}/"),
        (["salience", "--url", "127.0.0.1:{port}"], "127.0.0.1:{port}"),
        (["evergreen", "hi", "--url", "127.0.0.1:{port}"], "127.0.0.1:{port}"),
        (["graphpipe", "--url", "http://127.0.0.1:{port}"], "http://127.0.0.1:{port}"),
    ],
)
def test_a_client_without_a_server_says_so(capsys, argv: list[str], url: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main([a.format(port=port) for a in argv]) == 1
    err = capsys.readouterr().err
    assert f"cannot connect to {url.format(port=port)}" in err and "tokenwire serve" in err
