"""Numbers are validated as numbers (a hostile-client probe): a seed past 2**64, NaN or infinity
in a sampling value, JSON's true/false where an integer belongs are 400s naming the field; a
refused request creates and changes nothing (no session left behind, a persistent session's
tokens as they were); the bearer scheme is case-insensitive. In process, on the no-model
engine: no forward pass, real sessions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.protocols.openai.conftest import MODEL, InProcess, http

KEY = "numbers-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}
NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN / Infinity, as a hostile client may


@pytest.fixture(scope="module")
def server(smollm2_source: Any) -> Iterator[InProcess]:
    from tokenwire.bench.random_tokens import RandomTokenModel
    from tokenwire.engine.engine import Engine

    engine = Engine(
        lambda: RandomTokenModel(smollm2_source.config),
        smollm2_source.tokenizer,
        name=MODEL,
        kv_cache_mb=64,
        max_running=2,
    )
    running = InProcess(engine, api_key=KEY)
    yield running
    running.close()
    engine.shutdown()


def post(server: InProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, reply = http("POST", f"{server.url}{path}", body, key=KEY)
    return status, reply


def open_sessions(server: InProcess) -> int:
    return server.engine.stats()["sessions"]


BAD_CHAT = [
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**64 + 5, "n": 2}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": INF}, "top_p"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": -INF}, "frequency_penalty"),
    ({"logit_bias": {"5": NAN}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"top_k": True}, "top_k"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": True}, "n"),
    ({"priority": False}, "priority"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHAT)
def test_bad_numbers_are_400s_naming_the_field(server: InProcess, change: dict, param: str) -> None:
    status, reply = post(server, "/chat/completions", {**CHAT, **change})
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], error


@pytest.mark.parametrize(
    ("change", "param"),
    [({"seed": 2**64}, "seed"), ({"prompt": [True, False]}, "prompt"), ({"logprobs": True}, "logprobs")],
)
def test_completions_refuse_them_too(server: InProcess, change: dict, param: str) -> None:
    status, reply = post(server, "/completions", {**TEXT, **change})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_refused_requests_leave_no_session_and_the_server_serves(server: InProcess) -> None:
    before = open_sessions(server)
    for body in ({**CHAT, "seed": 2**64}, {**TEXT, "seed": 2**64, "n": 2}, {**CHAT, "temperature": NAN}):
        for _ in range(20):
            assert post(server, "/chat/completions" if "messages" in body else "/completions", body)[0] == 400
    assert open_sessions(server) == before
    status, reply = post(server, "/chat/completions", {**CHAT, "seed": 7})
    assert status == 200 and reply["choices"][0]["finish_reason"], reply
    assert open_sessions(server) == before  # a one-off request's session went with it


def test_the_choices_seeds_wrap_modulo_2_64(server: InProcess) -> None:
    """seed 2**64-1 with n=2: choice 1 samples with seed 0 (engine/request.py's choice_seed)."""
    body = {**TEXT, "max_tokens": 6, "temperature": 1.0}
    status, both = post(server, "/completions", {**body, "seed": 2**64 - 1, "n": 2})
    assert status == 200, both
    texts = [c["text"] for c in sorted(both["choices"], key=lambda c: c["index"])]
    assert post(server, "/completions", {**body, "seed": 2**64 - 1})[1]["choices"][0]["text"] == texts[0]
    assert post(server, "/completions", {**body, "seed": 0})[1]["choices"][0]["text"] == texts[1]


def session_tokens(server: InProcess, sid: str) -> list[int]:
    status, _, body = http("GET", f"{server.url}/sessions/{sid}", key=KEY)
    assert status == 200, body
    return body["tokens"]


def test_a_refused_request_leaves_a_persistent_session_as_it_was(server: InProcess) -> None:
    status, created = post(server, "/sessions", {"prompt": "Once upon a time"})
    assert status == 200, created
    sid = created["id"]
    kept = session_tokens(server, sid)
    before = open_sessions(server)
    bad = [
        ("/completions", {**TEXT, "session": sid, "seed": 2**64}),
        ("/completions", {**TEXT, "session": sid, "seed": 2**64, "n": 3}),
        ("/chat/completions", {**CHAT, "session": sid, "temperature": NAN}),
        ("/chat/completions", {**CHAT, "session": sid, "top_k": True}),
        ("/sessions/" + sid + "/truncate", {"length": True}),
        ("/sessions/" + sid + "/fork", {"at": True}),
    ]
    for path, body in bad * 3:
        status, reply = post(server, path, body)
        assert status == 400, (path, reply)
        assert session_tokens(server, sid) == kept, path
    assert open_sessions(server) == before  # no fork of an n=3 request left behind
    status, reply = post(server, "/completions", {**TEXT, "prompt": " there", "session": sid, "seed": 1})
    assert status == 200, reply
    assert session_tokens(server, sid)[: len(kept)] == kept and len(session_tokens(server, sid)) > len(kept)
    assert http("DELETE", f"{server.url}/sessions/{sid}", key=KEY)[0] == 200


def test_a_session_prompt_of_booleans_is_refused(server: InProcess) -> None:
    before = open_sessions(server)
    status, reply = post(server, "/sessions", {"prompt": [True, False]})
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    status, reply = post(server, "/sessions", {"ttl": NAN})
    assert status == 400 and reply["error"]["param"] == "ttl", reply
    assert open_sessions(server) == before


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(server: InProcess, scheme: str) -> None:
    import urllib.request

    request = urllib.request.Request(f"{server.url}/models", headers={"Authorization": f"{scheme} {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


@pytest.mark.parametrize("header", [f"Basic {KEY}", f"Bearer{KEY}", "Bearer wrong", KEY])
def test_another_scheme_or_key_is_refused(server: InProcess, header: str) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server.url}/models", headers={"Authorization": header})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
