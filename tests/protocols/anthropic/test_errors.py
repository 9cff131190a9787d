"""Errors of the Anthropic routes in Anthropic's shape and status, through the real client and
raw HTTP, and a client that leaves mid-stream cancelling its engine request."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import anthropic
import httpx
import pytest

from tests.protocols.openai.conftest import API_KEY, MODEL, metric

pytestmark = pytest.mark.slow
ASK = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def post(
    root: str, body: Any, headers: dict[str, str] | None = None, path: str = "/v1/messages"
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN as Python writes it
    sent = {"x-api-key": API_KEY, "content-type": "application/json", **(headers or {})}
    return httpx.post(f"{root}{path}", content=content, headers=sent, timeout=120)


def error_of(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


def test_a_bad_field_is_a_400_invalid_request_error_through_the_client(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**ASK, extra_body={"frobnicate": 1})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in info.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),  # Python's json writes NaN: sent as is
        ({"top_k": True}, "top_k"),
        ({"temperature": 1.5}, "temperature"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            },
            "image",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [{"name": "f", "input_schema": {}}]},
            "tool_choice",
        ),
    ],
)
def test_invalid_requests_are_400s(root: str, change: dict[str, Any], named: str) -> None:
    body = {k: v for k, v in {**ASK, **change}.items() if v is not None}
    assert named in error_of(post(root, body), 400, "invalid_request_error")


def test_a_body_that_is_not_json_is_a_400(root: str) -> None:
    assert "JSON" in error_of(post(root, b"{nope"), 400, "invalid_request_error")


def test_an_unknown_model_is_a_404_not_found_error(root: str) -> None:
    error_of(post(root, {**ASK, "model": "claude-nope"}), 404, "not_found_error")


def test_a_wrong_key_is_a_401_authentication_error(root: str) -> None:
    wrong = anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(**ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": "", "authorization": "Bearer wrong"}):
        error_of(post(root, ASK, headers), 401, "authentication_error")
    error_of(
        post(root, ASK, {"x-api-key": "wrong"}, "/v1/messages/count_tokens"), 401, "authentication_error"
    )
    assert post(root, ASK, {"x-api-key": "", "authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_count_tokens_refuses_in_the_same_shape(root: str) -> None:
    path = "/v1/messages/count_tokens"
    assert "max_tokens" in error_of(post(root, ASK, path=path), 400, "invalid_request_error")
    body = {"model": MODEL, "messages": ASK["messages"]}
    assert post(root, body, path=path).json()["input_tokens"] > 0


def _running(root: str) -> int:
    return int(httpx.get(f"{root}/health", timeout=30).json()["running"])


def _wait_idle(root: str) -> None:
    for _ in range(1200):  # a hang guard: the outcome below is what the test asserts
        if _running(root) == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the engine is still busy")


def test_a_client_leaving_mid_stream_cancels_its_request(client: Any, root: str) -> None:
    """The grammar makes the answer 1000 numbers long, so only a cancel ends it early."""
    _wait_idle(root)
    before = metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="anthropic")
    finished = metric(root, "tokenwire_requests_total", outcome="length", protocol="anthropic")
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    with client.messages.stream(
        **{**ASK, "max_tokens": 4000},
        output_config={"format": {"type": "json_schema", "schema": schema}},
    ) as stream:
        events = iter(stream)
        for _ in range(5):
            next(events)
        assert _running(root) == 1
    _wait_idle(root)
    assert metric(root, "tokenwire_requests_total", outcome="cancelled", protocol="anthropic") == before + 1
    assert metric(root, "tokenwire_requests_total", outcome="length", protocol="anthropic") == finished


def test_a_wrong_method_is_answered_in_anthropics_shape(root: str) -> None:
    response = httpx.get(f"{root}/v1/messages", headers={"x-api-key": API_KEY}, timeout=30)
    error_of(response, 405, "invalid_request_error")


def test_a_body_over_the_cap_is_a_413_in_anthropics_shape(root: str) -> None:
    """A declared Content-Length over --http-max-body-mb: refused before any of it is read."""
    host, port = root.removeprefix("http://").split(":")
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nx-api-key: {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {2**40}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        header, _, body = data.partition(b"\r\n\r\n")
        length = int(
            next(line for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")).split(
                b":"
            )[1]
        )
        while len(body) < length:
            body += sock.recv(65536)
    assert header.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["type"] == "request_too_large"
