"""The runtime process driven over real shared memory by the independent harness (shm_harness)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import uuid

import numpy as np
import pytest
import wasmtime

from tests.protocols.aici.shm_harness import Harness

TINY_WAT = """(module (memory (export "memory") 1)
  (func (export "tw_alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "init_prompt") (param i32 i32) (result i32) (i32.const 0))
  (func (export "pre_process") (result i32) (i32.const 0))
  (func (export "mid_process") (result i32) (i32.const 0))
  (func (export "post_process") (param i32 i32 i32) (result i32) (i32.const %d)))"""

DIGITS = {"steps": [{"fixed": "The answer is "}, {"gen": {"regex": "[0-9][0-9]"}}]}


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("aici-store"))
    assert h.main({"op": "ping"}) == {"type": "ok", "data": {"pong": 1}}
    tokens = h.main({"op": "tokens"})
    h.vocab_size = tokens["data"]["vocab_size"]
    yield h
    h.close()


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.tokenizer


def _instantiate(rt, req_id, module_id, arg, prompt=None):
    reply = rt.side("instantiate", req_id=req_id, prompt=prompt or [], module_id=module_id, module_arg=arg)
    assert reply["type"] == "ok", reply
    assert reply["data"]["error"] == "", reply
    return reply["data"]


def _step(rt, post=(), pre=(), freed=()):
    reply = rt.main(
        {"op": "post_pre_process", "post_ops": list(post), "pre_ops": list(pre), "freed": list(freed)}
    )
    assert reply["type"] == "ok", reply
    return reply["data"]


def _mid(rt, ops):
    reply = rt.main({"op": "mid_process", "ops": list(ops)})
    assert reply["type"] == "ok", reply
    return reply["data"], rt.biases(reply["data"]["num_seqs"])


def test_ping_and_tokens(rt, tok):
    assert rt.main({"op": "ping"})["data"] == {"pong": 1}
    data = rt.main({"op": "tokens"})["data"]
    assert data["vocab_size"] == tok.vocab_size == 49152
    assert data["eos_token_id"] in tok.eos_token_ids


def test_side_ops_modules_and_tags(rt):
    wasm = wasmtime.wat2wasm(TINY_WAT % 7)
    up = rt.side("mk_module", binary=base64.b64encode(wasm).decode())
    assert up["type"] == "ok", up
    assert up["data"]["module_id"] == hashlib.sha256(wasm).hexdigest()
    assert up["data"]["wasm_size"] == len(wasm) and up["data"]["compiled_size"] > 0
    mid = up["data"]["module_id"]
    tagged = rt.side("set_tags", module_id=mid, tags=["tiny-a", "tiny-b"])
    assert tagged["type"] == "ok"
    recs = tagged["data"]["tags"]
    assert [r["tag"] for r in recs] == ["tiny-a", "tiny-b"]
    assert all(
        r["module_id"] == mid and r["updated_by"] == "tester" and r["wasm_size"] == len(wasm) for r in recs
    )
    tags = rt.side("get_tags")["data"]["tags"]
    by_tag = {r["tag"]: r for r in tags}
    assert by_tag["tiny-a"]["module_id"] == mid
    assert {"jsctrl-latest", "llguidance", "declctrl"} <= set(by_tag)
    stamps = [r["updated_at"] for r in tags]
    assert stamps == sorted(stamps, reverse=True)  # newest first
    # several side requests in flight at once, answered by $rid
    rids = [rt.side_send({"op": "get_tags"}) for _ in range(4)]
    assert all(rt.side_wait(r)["type"] == "ok" for r in reversed(rids))


def test_several_sequences_biases_from_bin_region(rt, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    _instantiate(rt, "s-digits", "declctrl", DIGITS, prompt=[1, 2, 3])
    _instantiate(rt, "s-json", "json_schema", json.dumps(schema))
    _instantiate(rt, "s-lark", "lark", 'start: "yes" | "no"')
    data = _step(
        rt,
        pre=[{"id": 1, "req_id": "s-digits"}, {"id": 2, "req_id": "s-json"}, {"id": 3, "req_id": "s-lark"}],
    )
    pre = data["pre_seqs"]
    assert set(pre) == {"1", "2", "3"}
    assert all(pre[k]["error"] == "" for k in pre), pre
    assert pre["1"]["result"]["ff_tokens"] == tok.encode("The answer is ", add_special_tokens=False)
    assert "FIXED" in pre["1"]["logs"]
    assert all(pre[k]["error"] == "" for k in pre), pre
    mid, bias = _mid(rt, [{"id": 3}, {"id": 1}, {"id": 2}])  # rows follow the order of ops
    assert mid["num_seqs"] == 3 and set(mid["seqs"]) == {"1", "2", "3"}
    table = tok.all_token_bytes()
    digits = {i for i, b in enumerate(table) if re.fullmatch(rb"[0-9]{1,2}", b)}
    assert set(np.flatnonzero(np.isfinite(bias[1])).tolist()) == digits
    yes_no = set(np.flatnonzero(np.isfinite(bias[0])).tolist())
    assert yes_no and all(b"yes".startswith(table[i]) or b"no".startswith(table[i]) for i in yes_no)
    assert tok.encode("yes", add_special_tokens=False)[0] in yes_no
    json_ok = set(np.flatnonzero(np.isfinite(bias[2])).tolist())
    assert tok.encode("{", add_special_tokens=False)[0] in json_ok and len(json_ok) < 1000
    # feed sampled tokens back: "4", "2" completes the regex -> stop on the next post
    four, two = tok.encode("4", add_special_tokens=False)[0], tok.encode("2", add_special_tokens=False)[0]
    yes = tok.encode("yes", add_special_tokens=False)
    data = _step(
        rt, post=[{"id": 1, "tokens": [four], "backtrack": 0}, {"id": 3, "tokens": yes, "backtrack": 0}]
    )
    assert data["post_seqs"]["1"]["result"] == {"stop": False}
    assert data["post_seqs"]["3"]["error"] == ""
    _mid(rt, [{"id": 1}])
    data = _step(rt, post=[{"id": 1, "tokens": [two], "backtrack": 0}])
    assert data["post_seqs"]["1"]["error"] == "" and "GEN-DONE '42'" in data["post_seqs"]["1"]["logs"]
    # program done: only EOS is allowed, and the next post says stop
    _, bias = _mid(rt, [{"id": 1}])
    assert set(np.flatnonzero(np.isfinite(bias[0])).tolist()) <= set(tok.eos_token_ids) | {0, 1, 2}
    data = _step(rt, post=[{"id": 1, "tokens": [tok.eos_token_ids[0]], "backtrack": 0}], freed=[2, 3])
    assert data["post_seqs"]["1"]["result"] == {"stop": True}
    assert "1" not in data["pre_seqs"]  # stopped sequences are not called again
    _step(rt, freed=[1])


def test_fork_backtrack_and_ff_tokens(rt, tok):
    prog = {
        "steps": [
            {"fixed": "Pick:"},
            {"fork": [[{"fixed": " A"}], [{"fixed": " B"}, {"fixed": " C", "backtrack": 1}]]},
            {"gen": {"regex": "[xy]"}},
        ]
    }
    _instantiate(rt, "f-req", "declctrl", prog)
    data = _step(rt, pre=[{"id": 10, "req_id": "f-req"}])
    res = data["pre_seqs"]["10"]["result"]
    assert res["num_forks"] == 2 and res["ff_tokens"] == tok.encode("Pick:", add_special_tokens=False)
    mid, _ = _mid(rt, [{"id": 10}, {"id": 11, "clone_id": 10}])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert mid["seqs"]["10"]["result"] == {"ff_tokens": enc(" A"), "backtrack": 0}
    assert mid["seqs"]["11"]["result"] == {"ff_tokens": enc(" B"), "backtrack": 0}
    data = _step(
        rt,
        post=[
            {"id": 10, "tokens": enc(" A"), "backtrack": 0},
            {"id": 11, "tokens": enc(" B"), "backtrack": 0},
        ],
    )
    assert data["post_seqs"]["10"]["error"] == data["post_seqs"]["11"]["error"] == ""
    # fork 1 now asks to drop one token and append " C" (backtrack + ff_tokens in mid_process)
    mid, bias = _mid(rt, [{"id": 11}, {"id": 10}])
    assert mid["seqs"]["11"]["result"] == {"ff_tokens": enc(" C"), "backtrack": 1}
    xy = {enc("x")[0], enc("y")[0]}
    assert xy <= set(np.flatnonzero(np.isfinite(bias[1])).tolist())
    data = _step(
        rt,
        post=[
            {"id": 11, "tokens": enc(" C"), "backtrack": 1},
            {"id": 10, "tokens": [enc("x")[0]], "backtrack": 0},
        ],
    )
    assert data["post_seqs"]["11"]["error"] == "" and data["post_seqs"]["11"]["result"] == {"stop": False}
    assert data["post_seqs"]["10"]["error"] == ""
    _step(rt, freed=[10, 11])
    # freed ids are gone
    assert rt.main({"op": "mid_process", "ops": [{"id": 10}]})["type"] == "error"


def test_malformed_inputs_get_error_replies(rt):
    bad = rt.main(b'{"op": "ping"')
    assert bad["type"] == "error" and "JSON" in bad["error"]
    assert rt.main(b"[1, 2]")["type"] == "error"
    unknown = rt.main({"op": "launch_rockets"})
    assert unknown["type"] == "error" and "launch_rockets" in unknown["error"]
    r = rt.main(
        {
            "op": "post_pre_process",
            "post_ops": [{"id": 777, "tokens": [1], "backtrack": 0}],
            "pre_ops": [],
            "freed": [],
        }
    )
    assert r["type"] == "error" and "777" in r["error"]
    r = rt.main({"op": "post_pre_process", "post_ops": [], "pre_ops": [], "freed": [778]})
    assert r["type"] == "error" and "778" in r["error"]
    r = rt.main({"op": "mid_process", "ops": [{"id": 779}]})
    assert r["type"] == "error" and "779" in r["error"]
    r = rt.main(
        {"op": "post_pre_process", "post_ops": [], "pre_ops": [{"id": 5, "req_id": "never"}], "freed": []}
    )
    assert r["type"] == "error" and "never" in r["error"]
    # side channel
    rid = rt.side_send(b'{"$rid": "broken-1", "op": "get_tags", ')
    assert rid == ""
    broken = rt.side_wait("broken-1")
    assert broken["type"] == "error" and "JSON" in broken["error"]
    r = rt.side("warp_drive")
    assert r["type"] == "error" and "warp_drive" in r["error"]
    r = rt.side("instantiate", req_id="x", prompt=[], module_id="no-such-tag", module_arg="")
    assert r["type"] == "error" and "no-such-tag" in r["error"]
    r = rt.side("instantiate", req_id="x", prompt=[], module_id="ab" * 32, module_arg="")
    assert r["type"] == "error" and "unknown module" in r["error"]
    r = rt.side("mk_module", binary=base64.b64encode(b"not wasm").decode())
    assert r["type"] == "error" and "WebAssembly" in r["error"]
    r = rt.side("set_tags", module_id="cd" * 32, tags=["t"])
    assert r["type"] == "error"
    # a controller-level failure (bad grammar) is an ok reply carrying the error
    r = rt.side("instantiate", req_id="bad-grammar", prompt=[], module_id="regex", module_arg="(unclosed")
    assert r["type"] == "ok" and "grammar" in r["data"]["error"] and "ERROR" in r["data"]["logs"]
    # still serving
    assert rt.main({"op": "ping"})["data"] == {"pong": 1}


def test_runtime_is_a_process_group_leader(rt):
    import os

    deadline = time.monotonic() + 5
    while os.getpgid(rt.proc.pid) != rt.proc.pid and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(rt.proc.pid) == rt.proc.pid


LOOP = "async function main(){ await $`x`; while (true) {} }\nstart(main)"
ALLOC = (
    "async function main(){ await $`x`; const a = []; while (true) a.push(new Array(100000).fill(1)) }\n"
    "start(main)"
)
THROW = "async function main(){ await $`x`; throw new Error('boom from the program') }\nstart(main)"


@pytest.mark.parametrize("program", [LOOP, ALLOC, THROW], ids=["loops", "allocates", "throws"])
def test_bad_controller_fails_only_its_own_sequence(rt, tok, program):
    pytest.importorskip("tokenwire.protocols.aici.jsctrl")
    tag = uuid.uuid4().hex[:8]
    _instantiate(rt, f"bad-{tag}", "jsctrl-latest", program)
    _instantiate(rt, f"good-{tag}", "declctrl", DIGITS)
    bad = 100 + 2 * (int(tag, 16) % 1000)
    good = bad + 1
    data = _step(rt, pre=[{"id": bad, "req_id": f"bad-{tag}"}, {"id": good, "req_id": f"good-{tag}"}])
    bad_error, bad_logs = "", ""
    four = tok.encode("4", add_special_tokens=False)[0]
    good_done = False
    for _ in range(6):  # a few steps: the good sequence samples "4", "4", then stops
        for sid, entry in data["pre_seqs"].items():
            if int(sid) == bad and entry["error"]:
                bad_error, bad_logs = entry["error"], entry["logs"]
        live = [
            s for s in (bad, good) if str(s) in data["pre_seqs"] and not data["pre_seqs"][str(s)]["error"]
        ]
        post = []
        if live:
            mid, bias = _mid(rt, [{"id": s} for s in live])
            for row, s in enumerate(live):
                entry = mid["seqs"][str(s)]
                if s == bad and entry["error"]:
                    bad_error, bad_logs = entry["error"], entry["logs"]
                    continue
                if entry["result"] and entry["result"].get("ff_tokens"):
                    post.append({"id": s, "tokens": entry["result"]["ff_tokens"], "backtrack": 0})
                    continue
                allowed = np.flatnonzero(np.isfinite(bias[row]))
                token = four if four in allowed else int(allowed[0])
                post.append({"id": s, "tokens": [token], "backtrack": 0})
        data = _step(rt, post=post)
        for sid, entry in data["post_seqs"].items():
            if int(sid) == bad and entry["error"]:
                bad_error, bad_logs = entry["error"], entry["logs"]
            if int(sid) == good:
                assert entry["error"] == "", entry
                good_done = good_done or entry["result"] == {"stop": True} or "GEN-DONE '44'" in entry["logs"]
        if bad_error and good_done:
            break
    assert bad_error, "the bad controller never failed"
    assert "ERROR" in bad_logs and bad_error in bad_logs
    assert good_done
    _step(rt, freed=[bad, good])
    assert rt.main({"op": "ping"})["data"] == {"pong": 1}


def _cpu_seconds(pid: int) -> float:
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_busy_wait_spins_for_the_next_command_then_sleeps(tmp_path):
    h = Harness(tmp_path, extra_args=["--busy-wait-time=400"])
    try:
        assert h.main({"op": "ping"})["type"] == "ok"
        t0, c0 = time.monotonic(), _cpu_seconds(h.proc.pid)
        time.sleep(0.25)
        spun = (_cpu_seconds(h.proc.pid) - c0) / (time.monotonic() - t0)
        time.sleep(0.35)  # the 400 ms spin is over
        t1, c1 = time.monotonic(), _cpu_seconds(h.proc.pid)
        time.sleep(0.5)
        idle = (_cpu_seconds(h.proc.pid) - c1) / (time.monotonic() - t1)
        # CPU shares, not durations: a spinner still gets a fifth of a core at load 7 on 2 cores
        # (0.4 could fail there), a sleeper ~0
        assert spun > 0.15, f"the runtime used {spun:.0%} of a core right after a reply"
        assert idle < 0.05, f"the runtime used {idle:.0%} of a core after its spin ended"
        assert h.main({"op": "ping"}) == {"type": "ok", "data": {"pong": 1}}  # and it still answers
    finally:
        h.close()
