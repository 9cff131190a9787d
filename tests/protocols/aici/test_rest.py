"""AICI's REST API on the real default model: /v1/run (SSE), controllers and tags."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path

import aiohttp
import pytest
import regex
import wasmtime

from tests.protocols.aici.test_jsctrl import SEED_PROGRAM as SEED
from tests.protocols.aici.test_runtime_shm import TINY_WAT
from tokenwire.engine.speculation import Speculator
from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.rest import AiciServer, tokenizer_spec


@pytest.fixture(scope="module")
def server(smollm2_engine, tmp_path_factory):
    loop = asyncio.new_event_loop()
    client = AiciClient(
        tokenizer=tokenizer_spec(smollm2_engine),
        runtime_args=[f"--store-dir={tmp_path_factory.mktemp('aici-rest')}", "--max-pre-ms=50"],
    )
    srv = loop.run_until_complete(AiciServer(smollm2_engine, client, port=0).start())
    yield loop, srv
    loop.run_until_complete(srv.stop())
    client.close()
    loop.close()


def _call(server, method, path, **kw):
    loop, srv = server

    async def go():
        async with aiohttp.ClientSession() as s, s.request(method, srv.url + path, **kw) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()

    return loop.run_until_complete(go())


def _run(server, body):
    status, ctype, raw = _call(server, "POST", "/v1/run", json=body)
    assert status == 200 and ctype.startswith("text/event-stream"), raw
    lines = [ln for ln in raw.decode().split("\n\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["object"] == "initial-run" and events[0]["id"].startswith("run-")
    runs = events[1:]
    assert all(
        e["object"] == "run" and set(e["usage"]) == {"sampled_tokens", "ff_tokens", "cost"} for e in runs
    )
    forks: dict[int, dict] = {}
    for e in runs:
        for f in e["forks"]:
            acc = forks.setdefault(f["index"], {"text": "", "logs": "", "error": "", "finish_reason": None})
            acc["text"] += f["text"]
            acc["logs"] += f["logs"]
            acc["error"] += f["error"]
            acc["finish_reason"] = f["finish_reason"] or acc["finish_reason"]
    return forks, runs


def test_seed_example_end_to_end(server):
    pytest.importorskip("tokenwire.protocols.aici.jsctrl")
    forks, runs = _run(server, {"controller": "jsctrl-latest", "controller_arg": SEED})
    assert list(forks) == [0]
    f = forks[0]
    assert f["error"] == "", f
    assert re.fullmatch(r"Ultimate answer is to the life, universe and everything is \d\d", f["text"]), f[
        "text"
    ]
    assert f["finish_reason"] == "aici-stop"
    usage = runs[-1]["usage"]
    assert usage["sampled_tokens"] >= 2 and usage["cost"] == 2 * usage["sampled_tokens"] + usage["ff_tokens"]


class _NoGuesses(Speculator):
    """Prompt lookup that never guesses: what runs as guesses is a controller's splice."""

    def propose(self, tokens: list[int], limit: int, threshold: float = 0.0) -> list[int]:
        return []


def test_declarative_fork_and_backtrack(server, monkeypatch):
    """The splice after a backtrack (" C") runs as guesses after the token before it, kept."""
    engine = server[1].engine
    monkeypatch.setattr("tokenwire.engine.engine.Speculator", _NoGuesses)
    before = engine.stats()
    prog = {
        "steps": [
            {"fixed": "Pick:"},
            {"fork": [[{"fixed": " A"}], [{"fixed": " B"}, {"fixed": " C", "backtrack": 1}]]},
            {"gen": {"regex": "[xy]{2}"}},
        ]
    }
    forks, _ = _run(server, {"controller": "declctrl", "controller_arg": prog})
    assert set(forks) == {0, 1}
    texts = sorted(f["text"] for f in forks.values())
    assert re.fullmatch(r"Pick: A[xy]{2}", texts[0]) or re.fullmatch(r" A[xy]{2}", texts[0]), texts
    assert any(re.fullmatch(r"(Pick:)? B↩ C[xy]{2}", t) for t in texts), texts
    assert all(f["finish_reason"] == "aici-stop" and f["error"] == "" for f in forks.values())
    after = engine.stats()
    kept = after["spec_accepted"] - before["spec_accepted"]
    assert kept == after["spec_proposed"] - before["spec_proposed"] >= 1


def test_regex_tag_with_prompt(server):
    forks, _ = _run(
        server, {"controller": "regex", "controller_arg": "(yes|no)", "prompt": "Is water wet? Answer:"}
    )
    assert forks[0]["text"] in ("yes", "no"), forks


def test_upload_and_tags(server):
    wasm = wasmtime.wat2wasm(TINY_WAT % 1)
    status, _, raw = _call(server, "POST", "/v1/controllers", data=wasm)
    assert status == 200, raw
    up = json.loads(raw)
    assert up["module_id"] == hashlib.sha256(wasm).hexdigest() and up["wasm_size"] == len(wasm)
    status, _, raw = _call(
        server, "POST", "/v1/controllers/tags", json={"module_id": up["module_id"], "tags": ["rest-t"]}
    )
    assert status == 200 and json.loads(raw)["tags"][0]["tag"] == "rest-t"
    status, _, raw = _call(server, "GET", "/v1/controllers/tags")
    tags = {t["tag"]: t for t in json.loads(raw)["tags"]}
    assert tags["rest-t"]["module_id"] == up["module_id"] and "jsctrl-latest" in tags


def test_bad_requests(server):
    assert _call(server, "POST", "/v1/controllers", data=b"nope")[0] == 400
    assert (
        _call(server, "POST", "/v1/run", data=b"{oops", headers={"Content-Type": "application/json"})[0]
        == 400
    )
    status, _, raw = _call(server, "POST", "/v1/run", json={"controller_arg": "x"})
    assert status == 400 and b"controller" in raw
    forks, _ = _run(server, {"controller": "no-such-tag", "controller_arg": ""})
    assert forks[0]["finish_reason"] == "fail" and "no-such-tag" in forks[0]["error"]
    forks, _ = _run(server, {"controller": "regex", "controller_arg": "(unclosed"})
    assert forks[0]["finish_reason"] == "fail" and "grammar" in forks[0]["error"]
    # still serving
    forks, _ = _run(server, {"controller": "regex", "controller_arg": "ok"})
    assert forks[0]["text"] == "ok"


# ---- published jsctrl samples, unchanged, on the real model -------------------------------------------

SAMPLES = Path(__file__).parent / "js_samples"
SCHEMA_HEAD = "Here is JSON objects for five European cities:\n["
# strings are cut at maxTokens: 50; \d is Unicode-aware (Rust regex)
SCHEMA_CITY = r'\{\n    "name": "[^\n]*,\n    "population": \d+,\n    "url": "[^\n]*\n'


def _sample_run(server, name: str, max_tokens: int = 256, finishes: tuple[str, ...] = ("aici-stop",)) -> dict:
    program = (SAMPLES / name).read_text(encoding="utf-8")
    forks, _ = _run(
        server, {"controller": "jsctrl-latest", "controller_arg": program, "max_tokens": max_tokens}
    )
    assert list(forks) == [0]
    f = forks[0]
    assert f["error"] == "" and f["finish_reason"] in finishes, f
    return f


def test_sample_hello_js(server):
    f = _sample_run(server, "hello.js")
    assert re.fullmatch(r"Ultimate answer is to the life, universe and everything is \d\d", f["text"]), f


def test_sample_hellots_ts(server):
    f = _sample_run(server, "hellots.ts")
    assert re.fullmatch(r"Hello [A-Z]+", f["text"]), f


def test_sample_schema_js(server):
    # up to three cities: fixed JSON keys, a JSON-string regex, \d+, and gen({options: [...]}) choosing
    # between another object and the closing bracket; console.log(start.textSince()) goes to the logs.
    # \d+ has no length limit, and a greedy 135M model can repeat a digit until max_tokens (seen
    # once: "population": 8111222222...): then the text so far must still obey the program.
    f = _sample_run(server, "schema.js", max_tokens=1000, finishes=("aici-stop", "length"))
    text = f["text"]
    assert text.startswith(SCHEMA_HEAD + "{\n"), text
    body = text[len(SCHEMA_HEAD) :]
    pattern = rf"(?:{SCHEMA_CITY}}},\n){{0,2}}{SCHEMA_CITY}(?:\]|}},\n)"
    if f["finish_reason"] == "length":
        assert regex.fullmatch(pattern, body, partial=True), body
        return
    assert re.fullmatch(pattern, body), body
    assert body in f["logs"]  # Label.textSince() printed by the program


# ---- controller work overlaps the model forward -------------------------------------------------------


def test_rounds_overlap_the_forward_and_change_nothing(server):
    _, srv = server
    coord = srv.coord
    body = {
        "controller": "regex",
        "controller_arg": "[a-z]+( [a-z]+){5}",
        "prompt": "A poem:",
        "max_tokens": 12,
    }
    coord.overlap = False
    try:
        before = coord.stats.json()
        plain, _ = _run(server, body)
        assert coord.stats.early_rounds == before["early_rounds"]
    finally:
        coord.overlap = True
    before = coord.stats.json()
    overlapped, runs = _run(server, body)
    after = coord.stats.json()
    assert overlapped == plain and len(plain[0]["text"]) > 0  # greedy: the same text either way
    sampled = runs[-1]["usage"]["sampled_tokens"]
    assert sampled >= 10
    # every sampled token's round but the last went out from on_token and was consumed after the next forward
    assert after["early_rounds"] - before["early_rounds"] >= sampled - 1
    assert after["overlapped"] - before["overlapped"] >= sampled - 1


def test_first_round_overlaps_the_prefill(server):
    """A new sequence's first round (assignment, pre_process, mid_process) starts when the
    sequence is created, so no round of an overlapped run runs on the sampling path."""
    _, srv = server
    coord = srv.coord
    body = {
        "controller": "regex",
        "controller_arg": "[a-z]+( [a-z]+){3}",
        "prompt": "Fruit:",
        "max_tokens": 8,
    }
    before = coord.stats.json()
    forks, _ = _run(server, body)
    after = coord.stats.json()
    assert forks[0]["finish_reason"] in ("aici-stop", "length") and forks[0]["error"] == ""
    rounds = after["rounds"] - before["rounds"]
    assert rounds >= 4
    assert after["early_rounds"] - before["early_rounds"] == rounds


def test_many_forks_in_lockstep_with_and_without_overlap(server):
    """Forks start as separate engine requests, so some sample a step before the others have
    started; a round then must wait for them (pre_process runs for every live sequence) rather
    than overwrite the results they have not used yet."""
    _, srv = server
    coord = srv.coord
    branches = [[{"fixed": f" {i}:"}, {"gen": {"regex": "( [a-z]+){2}", "max_tokens": 8}}] for i in range(12)]
    body = {"controller": "declctrl", "controller_arg": {"steps": [{"fixed": "Words:"}, {"fork": branches}]}}
    results = []
    for overlap in (True, False, True):
        coord.overlap = overlap
        try:
            forks, _ = _run(server, body)
        finally:
            coord.overlap = True
        assert len(forks) == 12
        for i, f in forks.items():
            assert f["error"] == "" and f["finish_reason"] == "aici-stop", (i, f)
        results.append({i: f["text"] for i, f in forks.items()})
    assert results[0] == results[1] == results[2]  # greedy: the same texts whichever way rounds run
    for i, text in results[0].items():
        assert re.fullmatch(r"(Words:)? \d+:( [a-z]+){2}", text), (i, text)
