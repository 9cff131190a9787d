"""Sessions outlive the process (issue 44): real `tokenwire serve` children on the shipped model
and a temporary --state-dir, stopped with SIGTERM or SIGKILL and started again on it.

"The same as without the restart" is checked bit for bit: the reference is the next turn on a
fork of the session made before the restart (same tokens, KV shared), and the engine's
arithmetic is batch-invariant (tests/engine/test_batch_invariance.py), so a turn whose KV came
back from disk, or was computed again, must give the very same logprobs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.state_server import MODEL, StateServer
from tokenwire.protocols.salience.client import Client, Session
from tokenwire.protocols.salience.client_session import SessionView

PROMPT = [(i * 7919) % 40000 + 100 for i in range(300)]  # 18 full blocks of 16, and a tail
NEXT = [504, 3457, 28, 1789, 2094]


def _session(server: StateServer, key: str | None = "key-a", prompt: list[int] = PROMPT) -> str:
    return server.post("/v1/sessions", {"model": MODEL, "prompt": prompt}, key)["id"]


def test_an_openai_session_survives_a_restart_with_its_key_and_its_kv_from_disk(tmp_path: Path) -> None:
    with StateServer(tmp_path) as server:
        sid = _session(server)
        server.turn(sid, [13], key="key-a")
        twin = server.post(f"/v1/sessions/{sid}/fork", {}, "key-a")["id"]
        reference = server.turn(twin, NEXT, key="key-a")  # the next turn, no restart
        before = server.tokens(sid, key="key-a")
        assert server.call("GET", f"/v1/sessions/{sid}", key="key-b")[0] == 404
        server.stop()
    with StateServer(tmp_path) as server:
        assert server.tokens(sid, key="key-a") == before  # same id, same tokens
        status, reply = server.call("GET", f"/v1/sessions/{sid}", key="key-b")
        assert status == 404 and "another API key" in reply["error"]["message"]
        body = {"model": MODEL, "session": sid, "prompt": NEXT, "max_tokens": 2}
        assert server.call("POST", "/v1/completions", body, key="key-b")[0] == 404
        assert server.call("DELETE", f"/v1/sessions/{sid}", key="key-b")[0] == 404
        assert server.turn(sid, NEXT, key="key-a") == reference
        assert server.metric("tokenwire_kv_disk_reads_total") >= len(PROMPT) // 16
        assert server.metric("tokenwire_sessions_persisted") == 2  # the session and its fork
        assert "disk_kv_tokens=" in server.log  # the access log says the turn read KV from disk
        server.stop()


def test_a_salience_session_survives_a_restart(tmp_path: Path) -> None:
    params = {"max_tokens": 4, "top_k": 1, "logprob_top_k": 2}
    ranges = [(len(PROMPT), len(PROMPT) + len(NEXT) + 4)]
    with StateServer(tmp_path) as server, Client(f"127.0.0.1:{server.grpc}") as client:
        session = client.open()
        session.complete(PROMPT, **params)
        twin = session.fork()
        reference, _ = twin.complete(NEXT, logprobs_ranges=ranges, **params)
        sid, before = session.id, session.dump()
        server.stop()
    with StateServer(tmp_path) as server, Client(f"127.0.0.1:{server.grpc}") as client:
        again = Session(client, SessionView(sid, 8192, before))
        assert again.dump() == before
        tokens, _ = again.complete(NEXT, logprobs_ranges=ranges, **params)
        assert [t.SerializeToString() for t in tokens] == [t.SerializeToString() for t in reference]
        assert server.metric("tokenwire_kv_disk_reads_total") > 0
        server.stop()


def test_sigkill_during_a_turn_keeps_every_committed_turn(tmp_path: Path) -> None:
    with StateServer(tmp_path) as server:
        sid = _session(server)
        server.turn(sid, NEXT, key="key-a")  # a committed turn
        committed = server.tokens(sid, key="key-a")
        twin = server.post(f"/v1/sessions/{sid}/fork", {}, "key-a")["id"]
        reference = server.turn(twin, [13], key="key-a")
        long = {"model": MODEL, "session": sid, "prompt": [11], "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True}  # fmt: skip

        def in_flight() -> None:
            with contextlib.suppress(OSError):  # the server dies under it
                server.call("POST", "/v1/completions", long, "key-a")

        threading.Thread(target=in_flight, daemon=True).start()
        deadline = time.monotonic() + 60
        while server.metric("tokenwire_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # well into the turn
        server.kill()
    with StateServer(tmp_path) as server:
        assert server.tokens(sid, key="key-a") == committed  # the turn in flight is all that is lost
        assert server.turn(sid, [13], key="key-a") == reference  # KV computed again: the same bits
        server.stop()


def test_a_corrupt_block_file_costs_only_its_session_a_recompute(tmp_path: Path) -> None:
    other = [t + 1 for t in PROMPT]
    with StateServer(tmp_path) as server:
        a, b = _session(server), _session(server, prompt=other)
        for sid in (a, b):
            server.turn(sid, [13], key="key-a")
        refs = {}
        for sid in (a, b):
            twin = server.post(f"/v1/sessions/{sid}/fork", {}, "key-a")["id"]
            refs[sid] = server.turn(twin, NEXT, key="key-a")
        server.stop()
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= 2 * (len(PROMPT) // 16)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the payload
    victim.write_bytes(bytes(data))
    with StateServer(tmp_path) as server:
        for sid in (a, b):
            assert server.turn(sid, NEXT, key="key-a") == refs[sid]
        assert server.metric("tokenwire_kv_disk_corrupt_total") == 1
        assert "is damaged" in server.log
        server.stop()


def test_a_truncated_database_loses_only_the_sessions_it_held(tmp_path: Path) -> None:
    prompts = [[(i * 31 + j * 7) % 40000 + 100 for i in range(2000)] for j in range(12)]
    with StateServer(tmp_path) as server:
        sessions = {_session(server, prompt=p): p for p in prompts}
        server.stop()
    db = tmp_path / "sessions.db"
    assert not Path(str(db) + "-wal").exists() or os.path.getsize(str(db) + "-wal") == 0  # checkpointed
    size = db.stat().st_size
    with open(db, "r+b") as f:  # the last pages gone: a few rows' token lists end there
        f.truncate(size - 3 * 4096)
    with StateServer(tmp_path) as server:
        assert "damaged" in server.log
        kept = [sid for sid in sessions if server.call("GET", f"/v1/sessions/{sid}", key="key-a")[0] == 200]
        assert 0 < len(kept) < len(sessions)
        for sid in kept:
            assert server.tokens(sid, key="key-a") == sessions[sid]  # whole, never garbled
        server.turn(kept[0], NEXT, key="key-a")  # and they serve
        server.stop()


def test_another_kv_arithmetic_or_model_never_serves_stale_kv(tmp_path: Path, tiny_model_dir: Path) -> None:
    with StateServer(tmp_path) as server:
        sid = _session(server)
        server.turn(sid, NEXT, key="key-a")
        server.stop()
    # the same model storing KV in fp32: the session is back, its KV computed again, none read
    with StateServer(tmp_path, "--kv-dtype", "fp32") as server:
        fresh = _session(server, prompt=server.tokens(sid, key="key-a"))
        assert server.turn(sid, [13], key="key-a") == server.turn(fresh, [13], key="key-a")
        assert server.metric("tokenwire_kv_disk_reads_total") == 0
        server.stop()
    # another model file: its sessions are not served here, and the log says why
    with StateServer(tmp_path, "--model", str(tiny_model_dir)) as server:
        assert server.call("GET", f"/v1/sessions/{sid}", key="key-a")[0] == 404
        assert "of another model file" in server.log
        server.stop()
    with StateServer(tmp_path) as server:  # back on the first model: still there, KV from disk
        server.turn(sid, [13], key="key-a")
        assert server.metric("tokenwire_kv_disk_reads_total") > 0
        server.stop()


def test_a_small_state_budget_evicts_whole_idle_sessions_and_serving_goes_on(tmp_path: Path) -> None:
    prompts = [[(i * 13 + j * 101) % 40000 + 100 for i in range(400)] for j in range(6)]
    # a RAM budget of about two such sessions, a disk budget of about three (23 KiB a token)
    args = ("--state-max-gb", str(3 * 400 * 23040 / 2**30))
    with StateServer(tmp_path, *args, kv_cache_mb=20) as server:
        sessions = [_session(server, prompt=p) for p in prompts]
        for sid in sessions * 2:
            server.turn(sid, [13], key="key-a", max_tokens=1)
        assert server.metric("tokenwire_kv_disk_evicted_sessions_total") > 0
        assert server.metric("tokenwire_kv_disk_bytes") <= 3 * 400 * 23040
        lengths = [len(server.tokens(sid, key="key-a")) for sid in sessions]
        server.stop()
    with StateServer(tmp_path, *args, kv_cache_mb=20) as server:
        assert [len(server.tokens(sid, key="key-a")) for sid in sessions] == lengths
        for sid in sessions:
            server.turn(sid, [13], key="key-a", max_tokens=1)
        server.stop()


def _wait_for_metric(server: StateServer, name: str, done: Callable[[float], bool]) -> float:
    """The metric once `done` holds of it (the write-behind thread works in the background)."""
    deadline = time.monotonic() + 60
    while not done(value := server.metric(name)):
        assert time.monotonic() < deadline, f"{name} still {value} after 60 s"
        time.sleep(0.1)
    return value


def _blocks(server: StateServer, sid: str) -> int:
    """The KV blocks on disk a session holds: its full ones and the partial one at its computed
    end (its last token, generated, is not computed yet)."""
    computed = len(server.tokens(sid, key="key-a")) - 1
    return computed // 16 + (computed % 16 > 0)


def test_idle_kv_reaches_disk_in_the_background_so_a_sigkill_loses_none_of_it(tmp_path: Path) -> None:
    """No eviction and no SIGTERM: the idle session's blocks are written by the write-behind
    thread (engine/kv_write_behind.py), so after a SIGKILL its next turn reads them from disk."""
    with StateServer(tmp_path) as server:
        sid = _session(server)
        server.turn(sid, [13, 14], key="key-a")  # 306 tokens, 305 computed: 19 full blocks and 1
        twin = server.post(f"/v1/sessions/{sid}/fork", {}, "key-a")["id"]
        reference = server.turn(twin, NEXT, key="key-a")  # (the twin's full blocks are the session's)
        computed = len(server.tokens(sid, key="key-a")) - 1  # (its last token, generated, is not)
        assert computed % 16
        # its full blocks and the partial one at its computed end (engine/persistence.py `tail`)
        _wait_for_metric(server, "tokenwire_kv_disk_blocks", lambda n: n >= computed // 16 + 1)
        assert server.metric("tokenwire_kv_disk_evicted_sessions_total") == 0
        server.kill()
    with StateServer(tmp_path) as server:
        assert server.turn(sid, NEXT, key="key-a") == reference
        assert server.metric("tokenwire_kv_disk_reads_total") == computed // 16 + 1
        # every computed position came from disk, the partial block's too: the turn computed
        # only its own 5 (a full block's worth less would mean the tail was not read)
        assert f"disk_kv_tokens={computed}" in server.log, server.log[-2000:]
        server.stop()


def test_a_closed_sessions_block_files_are_removed_and_the_others_kept(tmp_path: Path) -> None:
    """What no open session holds goes: a closed session's files, and a session's older partial
    block once a turn wrote a newer one (engine/kv_write_behind.py's collection)."""
    other = [t + 1 for t in PROMPT]  # no block in common with PROMPT
    with StateServer(tmp_path) as server:
        kept, closed = _session(server, prompt=other), _session(server)
        for sid in (kept, closed):
            server.turn(sid, [13, 14], key="key-a")  # 305 computed: 19 full blocks and 1
        both = _blocks(server, kept) + _blocks(server, closed)
        _wait_for_metric(server, "tokenwire_kv_disk_blocks", lambda n: n == both)
        closed_blocks = _blocks(server, closed)
        server.turn(kept, [15], key="key-a")  # 310 computed: the same full blocks, a newer partial one
        deadline = time.monotonic() + 60
        while "KV block files: 1 no open session holds removed" not in server.log:  # the older one
            assert time.monotonic() < deadline, server.log[-2000:]
            time.sleep(0.1)
        kept_blocks = _blocks(server, kept)
        _wait_for_metric(server, "tokenwire_kv_disk_blocks", lambda n: n == kept_blocks + closed_blocks)
        assert server.call("DELETE", f"/v1/sessions/{closed}", key="key-a")[0] == 200
        _wait_for_metric(server, "tokenwire_kv_disk_blocks", lambda n: n == kept_blocks)
        twin = server.post(f"/v1/sessions/{kept}/fork", {}, "key-a")["id"]
        reference = server.turn(twin, NEXT, key="key-a")
        server.kill()
    with StateServer(tmp_path) as server:
        assert server.turn(kept, NEXT, key="key-a") == reference  # its files were all kept
        assert server.metric("tokenwire_kv_disk_reads_total") >= kept_blocks
        server.stop()
