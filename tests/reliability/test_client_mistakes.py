"""Issue 29: no 500 for a client's mistake. Each input below was answered 500 (or worse); each is
now the protocol's own invalid-input error naming what was wrong, and the server goes on serving."""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

import pytest

from tests.reliability.conftest import MODEL, Servers

# a regex llguidance accepts at compile time but whose lexer gives up once output reaches the
# counted repetition ("lexer error: too many expressions constructed")
EXPLODING_REGEX = "(a|aa)*" * 50 + "b{1000000}"


@pytest.fixture(scope="module")
def servers(engine: Any):
    servers = Servers(engine)
    yield servers
    servers.stop()


def raw_post(servers: Servers, path: str, body: bytes) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", servers.ports["http"], timeout=60)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        connection.close()


def openai_client(servers: Servers) -> Any:
    import openai

    return openai.OpenAI(base_url=servers.url("http"), api_key="none", max_retries=0, timeout=60)


def assert_served(servers: Servers) -> None:
    out = openai_client(servers).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_openai_chat_with_an_encoded_lone_surrogate_is_400(servers: Servers) -> None:
    """The body's bytes are not UTF-8 (a surrogate encoded as \\xed\\xa0\\x80): was 500 plain text."""
    head = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "@"}]})
    body = head.encode().replace(b"@", b"\xed\xa0\x80 x")
    status, content_type, payload = raw_post(servers, "/v1/chat/completions", body)
    assert status == 400, (status, payload)
    assert content_type.startswith("application/json")
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages", error
    assert "surrogate" in error["message"], error
    assert_served(servers)


def test_openai_completion_prompt_with_a_lone_surrogate_is_400(servers: Servers) -> None:
    body = json.dumps({"model": MODEL, "prompt": "\ud800", "max_tokens": 2}).encode()
    assert b'"\\ud800"' in body  # escaped JSON: the openai client cannot even encode it
    status, _, payload = raw_post(servers, "/v1/completions", body)
    assert status == 400, (status, payload)
    error = json.loads(payload)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt", error
    assert "surrogate" in error["message"], error
    assert_served(servers)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_regex_the_grammar_library_gives_up_on_is_400(servers: Servers, stream: bool) -> None:
    import openai

    client = openai_client(servers)
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 64, "seed": 1}
    kwargs["extra_body"] = {"regex": EXPLODING_REGEX}
    if stream:  # the status line is out before the grammar fails: the error is the last event
        with pytest.raises(openai.APIError) as caught:
            for _ in client.completions.create(stream=True, **kwargs):
                pass
        error = caught.value.body
    else:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**kwargs)
        error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_grammar", error
    assert "too many expressions" in error["message"], error
    assert_served(servers)


def test_evergreen_regex_the_grammar_library_gives_up_on_is_invalid_argument(servers: Servers) -> None:
    from tokenwire.protocols.evergreen.client import (
        ConstraintConfig,
        EvergreenError,
        EvergreenSession,
        GenerateConfig,
    )

    async def run() -> str:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            config = GenerateConfig(max_tokens=64, seed=1)
            out = session.generate("Hi", config, constraint=ConstraintConfig(regex=EXPLODING_REGEX))
            try:
                await out.text()
            except EvergreenError as exc:
                return f"{exc.code} {exc.details}"
        return "ok"

    result = asyncio.run(asyncio.wait_for(run(), 60))
    assert result.startswith("INVALID_ARGUMENT") and "too many expressions" in result, result
