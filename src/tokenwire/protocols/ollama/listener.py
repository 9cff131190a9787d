"""`--ollama-port`: the port is bound with the others before the model loads (light to import:
the server itself, server.py, loads when it starts)."""

from __future__ import annotations

import argparse
import socket
from typing import TYPE_CHECKING

from tokenwire.protocols.serving import Listener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

DEFAULT_OLLAMA_PORT = 11434  # where Ollama's clients look by default


class WithOllamaPort:
    """The OpenAI API's listener (None when --http-port is 0) and the --ollama-port socket."""

    def __init__(self, inner: Listener | None, sock: socket.socket, args: argparse.Namespace) -> None:
        self.inner = inner
        self.sock = sock
        self.args = args

    async def start(self, engine: EngineAPI) -> Stopper:
        # local: the server loads FastAPI, uvicorn and the engine's types; `serve --help` needs none
        from tokenwire.protocols.ollama.server import start_ollama_server

        stops: list[Stopper] = []
        if self.inner is not None:
            stops.append(await self.inner.start(engine))
        stops.append(await start_ollama_server(engine, self.sock, self.args))

        async def stop() -> None:
            for each in reversed(stops):
                await each()

        return stop

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.sock.close()


def with_ollama_port(inner: Listener | None, args: argparse.Namespace) -> Listener | None:
    """`inner`, plus Ollama's own listener when --ollama-port is given."""
    port = getattr(args, "ollama_port", 0)
    if not port:
        return inner
    try:
        sock = bind_tcp(args.host, port, "--ollama-port")
    except BaseException:
        if inner is not None:
            inner.close()
        raise
    return WithOllamaPort(inner, sock, args)
