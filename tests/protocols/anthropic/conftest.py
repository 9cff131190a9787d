"""One `tokenwire serve` (the HTTP API only, an API key) on SmolLM2 for the Anthropic tests, and
the real `anthropic` client against it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.protocols.openai.conftest import API_KEY, openai_only_serve


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    """http://127.0.0.1:PORT of a server with --api-key (one per test module)."""
    with openai_only_serve("--api-key", API_KEY) as (port, _):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(root: str) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=root, api_key=API_KEY, max_retries=0, timeout=120)
