"""`tokenwire chat` against the live server: the same conversation with and without a session."""

from __future__ import annotations

import argparse
import io

import pytest

from tests.protocols.openai.conftest import API_KEY, http
from tokenwire.protocols.openai.chat_cli import run_chat

pytestmark = pytest.mark.slow


def _chat(url: str, session: bool) -> str:
    args = argparse.Namespace(
        url=url,
        api_key=API_KEY,
        model=None,
        system="Be brief.",
        temperature=0.0,
        max_tokens=12,
        session=session,
    )
    out = io.StringIO()
    assert run_chat(args, io.StringIO("Name a colour.\n\nAnd an animal?\n/quit\n"), out) == 0
    return out.getvalue()


def test_chat_with_and_without_a_session_says_the_same(openai_server: str, root: str) -> None:
    before = http("GET", f"{root}/health")[2]["sessions"]
    plain = _chat(openai_server, session=False)
    kept = _chat(openai_server, session=True)
    assert plain.count("\n") == 2 and plain.strip()
    assert kept == plain
    assert http("GET", f"{root}/health")[2]["sessions"] == before  # the session was deleted on exit
