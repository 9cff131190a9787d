"""Sessions over HTTP: fork, truncate, delete, and completions continuing a session."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.protocols.openai.conftest import MODEL, http

pytestmark = pytest.mark.slow


def complete(client: Any, prompt: str | list[int], session: str | None = None, n: int = 6) -> Any:
    extra = {"session": session} if session is not None else {}
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body=extra
    )


def tokens(openai_server: str, session: str) -> list[int]:
    status, _, body = http("GET", f"{openai_server}/sessions/{session}")
    assert status == 200, body
    return body["tokens"]


def test_fork_at_a_position_and_continue_both_branches(client: Any, openai_server: str) -> None:
    status, _, parent = http("POST", f"{openai_server}/sessions", {"prompt": "Once upon a time"})
    assert status == 200 and parent["length"] > 0
    sid = parent["id"]
    start = parent["length"]
    complete(client, " there was", sid)
    grown = tokens(openai_server, sid)
    status, _, child = http("POST", f"{openai_server}/sessions/{sid}/fork", {"at": start})
    assert status == 200 and child["length"] == start and child["id"] != sid
    a = complete(client, " a dragon", sid)
    b = complete(client, " a princess", child["id"])
    # each branch holds its own continuation on top of what it shared
    parent_tokens, child_tokens = tokens(openai_server, sid), tokens(openai_server, child["id"])
    assert parent_tokens[: len(grown)] == grown
    assert child_tokens[:start] == grown[:start] and child_tokens[start:] != parent_tokens[start:]
    # and each equals the same tokens run from scratch (no session)
    a_prompt = parent_tokens[: len(parent_tokens) - a.usage.completion_tokens]
    b_prompt = child_tokens[: len(child_tokens) - b.usage.completion_tokens]
    assert complete(client, a_prompt).choices[0].text == a.choices[0].text
    assert complete(client, b_prompt).choices[0].text == b.choices[0].text
    for s in (sid, child["id"]):
        assert http("DELETE", f"{openai_server}/sessions/{s}")[0] == 200


def test_truncate_then_generate_equals_a_fresh_session(client: Any, openai_server: str) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {"prompt": "The three primary colours are"})
    sid = session["id"]
    complete(client, " red, yellow and", sid, n=10)
    kept = tokens(openai_server, sid)[: session["length"] + 3]
    status, _, body = http("POST", f"{openai_server}/sessions/{sid}/truncate", {"length": len(kept)})
    assert status == 200 and body["length"] == len(kept)
    rewound = complete(client, " and", sid)
    _, _, fresh = http("POST", f"{openai_server}/sessions", {"prompt": kept})
    again = complete(client, " and", fresh["id"])
    assert rewound.choices[0].text == again.choices[0].text
    assert rewound.usage.prompt_tokens_details.cached_tokens >= len(kept) - 1
    assert tokens(openai_server, sid) == tokens(openai_server, fresh["id"])
    for s in (sid, fresh["id"]):
        http("DELETE", f"{openai_server}/sessions/{s}")


def test_deleted_session_is_gone_everywhere(client: Any, openai_server: str) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {"prompt": [1, 2, 3], "ttl": 60})
    sid = session["id"]
    status, _, body = http("DELETE", f"{openai_server}/sessions/{sid}")
    assert status == 200 and body == {"id": sid, "object": "session.deleted", "deleted": True}
    for method, path, payload in [
        ("GET", f"/sessions/{sid}", None),
        ("POST", f"/sessions/{sid}/fork", {}),
        ("POST", f"/sessions/{sid}/truncate", {"length": 0}),
        ("DELETE", f"/sessions/{sid}", None),
        ("POST", "/completions", {"model": MODEL, "prompt": "x", "session": sid}),
        (
            "POST",
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "session": sid},
        ),
    ]:
        status, _, body = http(method, openai_server + path, payload)
        assert status == 404, (path, body)
        assert body["error"]["code"] == "session_not_found" and body["error"]["param"] == "session"


def test_session_positions_are_checked(openai_server: str) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {"prompt": [1, 2, 3]})
    sid = session["id"]
    status, _, body = http("POST", f"{openai_server}/sessions/{sid}/fork", {"at": 4})
    assert status == 400 and body["error"]["param"] == "at" and "4" in body["error"]["message"]
    status, _, body = http("POST", f"{openai_server}/sessions/{sid}/truncate", {"length": 9})
    assert status == 400 and body["error"]["param"] == "length"
    status, _, body = http("POST", f"{openai_server}/sessions", {"prompt": [10**9]})
    assert status == 400 and body["error"]["code"] == "invalid_token"
    http("DELETE", f"{openai_server}/sessions/{sid}")


def test_n_choices_on_a_session_leave_only_the_first_in_it(
    client: Any, openai_server: str, root: str
) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {})
    sid = session["id"]
    before = http("GET", f"{root}/health")[2]["sessions"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say a word."}],
        n=2,
        seed=11,
        temperature=1.0,
        max_tokens=8,
        extra_body={"session": sid},
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    state = http("GET", f"{openai_server}/sessions/{sid}")[2]
    first = reply.choices[0]
    ending = first.message.content + ("<|im_end|>" if first.finish_reason == "stop" else "")
    assert state["text"].endswith(ending)
    assert http("GET", f"{root}/health")[2]["sessions"] == before  # the forks of choice 1 are gone
    http("DELETE", f"{openai_server}/sessions/{sid}")


def test_a_session_expires_after_its_ttl(openai_server: str) -> None:
    _, _, session = http("POST", f"{openai_server}/sessions", {"prompt": "hello", "ttl": 0.5})
    deadline = time.monotonic() + 10
    while http("GET", f"{openai_server}/sessions/{session['id']}")[0] == 200:
        assert time.monotonic() < deadline, "the session never expired"
        time.sleep(0.2)
    assert http("GET", f"{openai_server}/sessions/{session['id']}")[0] == 404
