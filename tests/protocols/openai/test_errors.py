"""Every error of the API in OpenAI's shape, the server serving others afterwards, and a client
that disconnects mid-stream freeing its engine request."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.protocols.openai.conftest import API_KEY, MODEL, InProcess, http, metric

pytestmark = pytest.mark.slow
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"n": 0}, "n"),
        ({"frobnicate": True}, "frobnicate"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"regex": "(unclosed"}, "regex"),
        ({"regex": "a+", "grammar": "start: 'a'"}, "grammar"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
        ),  # auto, no template support
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"readouts": True}, "readouts"),  # no --concepts
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_invalid_fields_are_400s_naming_the_field(openai_server: str, change: dict, param: str) -> None:
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    status, _, reply = http("POST", f"{openai_server}/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"]


def test_prompt_longer_than_the_context_is_a_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1] * 8193, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "8192" in info.value.message


def test_unsupported_completion_fields_say_so(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert info.value.param == "suffix" and "not supported" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert info.value.param == "messages.0.content.0.type"


def test_api_key_is_required_on_v1_only(openai_server: str, root: str) -> None:
    for key in (None, "wrong"):
        status, _, body = http("GET", f"{openai_server}/models", key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=openai_server, api_key="wrong", max_retries=0).models.list()
    status, _, body = http("GET", f"{root}/health", key=None)
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert http("GET", f"{root}/ready", key=None)[0] == 200
    status, _, schema = http("GET", f"{root}/openapi.json", key=None)
    assert status == 200 and "ChatCompletionRequest" in schema["components"]["schemas"]


def test_unknown_model_and_session_are_404s(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(**CHAT, extra_body={"session": "0" * 32})
    assert info.value.code == "session_not_found"


def _health(root: str) -> dict:
    return http("GET", f"{root}/health", key=None)[2]


def _wait_idle(root: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _health(root)
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {health}")


def test_disconnect_mid_stream_cancels_the_request(client: Any, root: str) -> None:
    """The engine request ends as cancelled, a few tokens in, not after its 4000: counted on
    /metrics (the wait for idle is a hang guard; the outcome is what the test asserts)."""
    _wait_idle(root)
    cancelled = metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="openai")
    finished = metric(root, "tokenwire_requests_total", outcome="length", protocol="openai")
    generated = metric(root, "tokenwire_generated_tokens_total", protocol="openai")
    stream = client.chat.completions.create(
        **{**CHAT, "max_tokens": 4000}, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert _health(root)["running"] == 1
    stream.close()
    _wait_idle(root, timeout=120)
    assert metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="openai") == cancelled + 1
    assert metric(root, "tokenwire_requests_total", outcome="length", protocol="openai") == finished
    assert metric(root, "tokenwire_generated_tokens_total", protocol="openai") - generated < 4000


def test_a_busy_session_is_a_409_and_the_server_keeps_serving(
    client: Any, openai_server: str, root: str
) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {})
    stream = client.chat.completions.create(
        **{**CHAT, "max_tokens": 4000}, stream=True, extra_body={"session": session["id"], "ignore_eos": True}
    )
    next(iter(stream))
    status, _, body = http("POST", f"{openai_server}/chat/completions", {**CHAT, "session": session["id"]})
    assert status == 409 and body["error"]["code"] == "session_busy"
    stream.close()
    _wait_idle(root)
    reply = client.chat.completions.create(**CHAT, temperature=0)  # after every error above
    assert reply.choices[0].message.content
    http("DELETE", f"{openai_server}/sessions/{session['id']}")


# ----------------------------------------------------------------------------- saturation (429)
@pytest.fixture
def saturable(random_engine: Any) -> Iterator[str]:
    """An in-process API that runs one request at a time and queues one."""
    server = InProcess(random_engine, max_queued=1)
    yield server.url
    server.close()


def test_a_saturated_engine_answers_429_with_retry_after(saturable: str) -> None:
    client = openai.OpenAI(base_url=saturable, api_key="none", max_retries=0)
    long = {**CHAT, "max_tokens": 8000, "extra_body": {"ignore_eos": True}}
    running = client.chat.completions.create(**long, stream=True)
    next(iter(running))
    queued: list[Any] = []
    waiter = threading.Thread(target=lambda: queued.append(client.chat.completions.create(**CHAT)))
    waiter.start()
    root = saturable.removesuffix("/v1")
    deadline = time.monotonic() + 10
    while http("GET", f"{root}/ready", key=None)[0] != 503:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.02)
    status, headers, body = http("POST", f"{saturable}/chat/completions", CHAT, key=None)
    assert status == 429 and headers.get("retry-after") == "1"
    assert body["error"]["code"] == "queue_full" and "--max-queued" in body["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)
    running.close()  # frees the engine: the queued request runs, new ones are admitted again
    waiter.join(30)
    assert queued and queued[0].choices[0].finish_reason == "length"
    assert client.chat.completions.create(**CHAT).usage.completion_tokens == 2


def test_api_key_env_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key defaults to $TOKENWIRE_API_KEY."""
    import argparse

    from tokenwire.protocols.openai.plugin import add_serve_args

    monkeypatch.setenv("TOKENWIRE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).api_key == "from-env"
    assert parser.parse_args(["--api-key", API_KEY]).api_key == API_KEY
    assert parser.parse_args([]).http_port == 8000


def test_a_stream_open_when_the_server_stops_ends_in_an_error(random_engine: Any) -> None:
    server = InProcess(random_engine)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            **{**CHAT, "max_tokens": 8000}, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        stopping = threading.Thread(target=server.close)
        stopping.start()
        with pytest.raises(openai.APIError, match="server shutting down"):
            for _ in chunks:
                pass
        stopping.join(10)
        assert not stopping.is_alive()
        assert random_engine.stats()["running"] == 0
    finally:
        server.close()


def test_metrics_are_served_on_the_api_port(client: Any, root: str) -> None:
    client.chat.completions.create(**CHAT, temperature=0)
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:  # open, like /health
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    assert 'tokenwire_requests_total{outcome="length",protocol="openai"}' in text
    assert "tokenwire_requests_running" in text
