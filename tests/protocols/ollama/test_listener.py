"""--ollama-port is bound with the other ports, before the model loads."""

from __future__ import annotations

import argparse
import socket

import pytest

from tokenwire.protocols.ollama.listener import WithOllamaPort, with_ollama_port
from tokenwire.protocols.serving import PortInUseError


class Inner:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_off_by_default_and_bound_when_given() -> None:
    inner = Inner()
    assert with_ollama_port(inner, argparse.Namespace(host="127.0.0.1", ollama_port=0)) is inner  # type: ignore[arg-type]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listener = with_ollama_port(None, argparse.Namespace(host="127.0.0.1", ollama_port=port))
    assert isinstance(listener, WithOllamaPort) and listener.sock.getsockname()[1] == port
    listener.close()


def test_a_taken_port_names_the_flag_and_releases_the_others() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        inner = Inner()
        args = argparse.Namespace(host="127.0.0.1", ollama_port=taken.getsockname()[1])
        with pytest.raises(PortInUseError, match="--ollama-port"):
            with_ollama_port(inner, args)  # type: ignore[arg-type]
        assert inner.closed
