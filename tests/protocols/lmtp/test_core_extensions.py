"""The four opt-in extensions in the sans-IO core: negotiation, text, buffers, system, retry."""

from __future__ import annotations

from tests.protocols.lmtp.fakes import Harness, records

M = "fake-model"
ALL = ["text", "buffers", "system", "retry"]


def hello(h: Harness, exts: list[str]) -> dict:
    frames = h.send("HELLO", {"stream_id": 0, "extensions": exts, "client": "test"})
    return next(r for r in records(frames, "MSG") if "hello" in r)["hello"]


def test_hello_enables_only_known_extensions_and_reports_the_model() -> None:
    h = Harness()
    reply = hello(h, ["retry", "telepathy", "text"])
    assert reply["extensions"] == ["text", "retry"] and reply["model"] == M and reply["status"] == "ready"
    assert reply["available"] == ALL
    assert hello(h, [])["extensions"] == []  # renegotiation turns them off again
    [(_, [err])] = h.send("CANCEL", {"stream_id": 1})
    assert "not negotiated" in err["error"]


# ---------------------------------------------------------------------- text
def test_text_prompts_and_text_of_characters_split_across_tokens() -> None:
    h = Harness()
    hello(h, ["text"])
    h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": "hé", "max_tokens": 4})
    handle, st = h.stream()
    assert handle.append == [1, *"hé".encode()]  # a whole-string prompt gets the tokenizer's BOS
    e_acute = "é".encode()  # two bytes, two tokens in the fake tokenizer
    h.token(st, e_acute[0], 4)
    h.token(st, e_acute[1], 5)
    h.token(st, ord("!"), 6)
    h.token(st, 0xE2, 7, finish="length")  # the first byte of a 3-byte character, cut off
    h.finish(st, "length", 4, 4)
    texts = [r["text"] for r in records(h.frames())]
    assert texts == ["", "é", "!", "\ufffd"]
    h.send("SCORE", {"stream_id": 2, "model": M, "prompt": ["a", 32], "scored": "ü"})
    handle, st = h.stream()
    assert handle.append == [ord("a"), 32, *"ü".encode()]  # strings in a list: no special tokens
    for i, t in enumerate("ü".encode()):
        h.token(st, t, 2 + i, prefill=True)
    h.finish(st, "length", 4)
    assert [r["text"] for r in records(h.frames())] == ["", "ü"]


# ---------------------------------------------------------------------- buffers
def test_buffers_are_sessions_computed_once_forked_per_request_and_saved() -> None:
    h = Harness()
    hello(h, ["buffers"])
    assert h.send("BUFFER", {"stream_id": 1, "name": "sys", "prompt": [1, 10, 11]}) == []
    prefill, st = h.stream()
    assert prefill.options.max_tokens == 0 and prefill.session is not None  # computed now
    h.finish(st, "length", 3)
    [(_, [reply])] = h.frames()
    assert reply == {"stream_id": 1, "buffer": {"name": "sys", "length": 3}}
    sys_session = h.conn.buffers.sessions["sys"]

    h.send(
        "GENERATE",
        {"stream_id": 2, "model": M, "buffer": "sys", "prompt": [20], "save_as": "turn1", "max_tokens": 1},
    )
    handle, st = h.stream()
    assert handle.session not in (None, sys_session) and handle.append == [20]  # a fork of the buffer
    assert h.engine.checked[-1] == 4  # admitted as the buffer's 3 tokens + 1
    h.token(st, 30, 4, finish="length")
    h.finish(st, "length", 4, 1)
    h.frames()
    assert h.engine.sessions[h.conn.buffers.sessions["turn1"]] == [
        1,
        10,
        11,
        20,
    ]  # + generated, in a real engine

    h.send("SCORE", {"stream_id": 3, "model": M, "prompt": [{"buffer": "sys"}, 5], "scored": [6]})
    handle, st = h.stream()
    assert handle.session is None and handle.append == [1, 10, 11, 5, 6]  # a buffer reference, spliced
    out = h.send("GENERATE", {"stream_id": 4, "model": M, "buffer": "nope", "prompt": [1]})
    assert "unknown buffer 'nope'" in records(out)[0]["error"]

    [(_, [dropped])] = h.send("DROP", {"stream_id": 5, "name": "sys"})
    assert dropped["buffer"] == {"name": "sys", "dropped": True} and sys_session not in h.engine.sessions
    [(_, [err])] = h.send("DROP", {"stream_id": 6, "name": "sys"})
    assert "unknown buffer" in err["error"]


def test_a_failed_stream_does_not_become_a_buffer() -> None:
    h = Harness()
    hello(h, ["buffers"])
    h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": [5], "save_as": "x"})
    handle, st = h.stream()
    h.finish(st, "cancelled")
    assert "x" not in h.conn.buffers.sessions and handle.session not in h.engine.sessions


# ---------------------------------------------------------------------- system
def test_system_messages_report_queue_position_and_shutdown() -> None:
    h = Harness()
    hello(h, ["system"])
    h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": [5]})
    handle, st = h.stream()
    h.engine.queue[id(handle)] = 3
    h.conn.tick()
    h.conn.tick()  # unchanged: said once
    [(_, [queued])] = h.frames()
    assert queued == {"stream_id": 1, "system": {"event": "queued", "position": 3}}
    del h.engine.queue[id(handle)]
    h.conn.tick()
    assert records(h.frames(), "MSG")[0]["system"] == {"event": "started"}
    h.token(st, 9, 1)
    h.conn.shutdown("bye")
    out = h.frames()
    assert records(out, "MSG")[0]["system"] == {"event": "shutdown", "message": "bye"}
    assert records(out)[-1] == {"stream_id": 1, "error": "bye"} and handle.cancelled


def test_no_system_messages_without_the_extension() -> None:
    h = Harness()
    h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": [5]})
    h.engine.queue[id(h.stream()[0])] = 0
    h.conn.tick()
    h.conn.shutdown()
    assert records(h.frames(), "MSG") == []


# ---------------------------------------------------------------------- retry
def test_a_resent_live_stream_replays_from_resume_from_and_goes_on() -> None:
    h = Harness()
    hello(h, ["retry"])
    req = {"stream_id": 1, "model": M, "prompt": [5], "max_tokens": 3}
    h.send("GENERATE", req)
    _, st = h.stream()
    h.token(st, 10, 1)
    h.token(st, 11, 2)
    assert [r["seq"] for r in records(h.frames())] == [0, 1]
    replay = records(h.send("GENERATE", {**req, "resume_from": 1}))
    assert [(r["token"], r["seq"]) for r in replay] == [(11, 1)] and len(h.watched) == 1  # no new work
    h.token(st, 12, 3, finish="length")
    h.finish(st, "length", 1, 3)
    assert [(r["token"], r["seq"], r["finish_reason"]) for r in records(h.frames())] == [(12, 2, "length")]
    again = records(h.send("GENERATE", req))  # finished: the whole stream again, from the log
    assert [r["token"] for r in again] == [10, 11, 12] and len(h.watched) == 1
    h.send("GENERATE", {**req, "stream_id": 2, "prompt": [6]})
    [(_, [dup])] = h.send("GENERATE", {**req, "stream_id": 2, "prompt": [7]})  # live, other request
    assert dup["code"] == "duplicate_stream" and dup["finish_reason"] == "error" and dup["retryable"] is False


def test_cancel_ends_a_stream_with_a_cancelled_error_record() -> None:
    h = Harness()
    hello(h, ["retry"])
    h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": [5]})
    handle, st = h.stream()
    h.send("CANCEL", {"stream_id": 1})
    assert handle.cancelled
    h.finish(st, "cancelled")
    [record] = records(h.frames())
    assert (record["code"], record["finish_reason"], record["error"]) == ("cancelled", "error", "cancelled")


def test_engine_errors_carry_codes_with_retry() -> None:
    h = Harness()
    hello(h, ["retry"])
    [(_, [record])] = h.send("GENERATE", {"stream_id": 1, "model": M, "prompt": [5, 400]})
    assert record["code"] == "invalid_token" and record["retryable"] is False
    [(_, [record])] = h.send("GENERATE", {"stream_id": 2, "model": "x", "prompt": [5]})
    assert record["code"] == "unknown_model"


def test_the_replay_log_is_bounded_by_streams_and_records() -> None:
    from tokenwire.protocols.lmtp.extensions import ReplayLog
    from tokenwire.protocols.lmtp.streams import GenerateStream

    log = ReplayLog(limit=3, max_records=10)
    for sid in range(5):
        log.add(GenerateStream(sid, "f", sent=[{}] * 4))
    assert list(log.streams) == [3, 4] and log.records_held == 8  # 3 streams would hold 12 records
    assert log.find(4, "f") is not None and log.find(4, "other") is None
    log.forget(4)
    assert log.records_held == 4


def test_line_transport_answers_waiting_requests_when_the_model_fails_to_load() -> None:
    import asyncio
    import json

    import pytest

    from tokenwire.protocols.lmtp.stdio import serve_lines

    async def go() -> list[str]:
        lines: asyncio.Queue[str | None] = asyncio.Queue()
        out: list[str] = []
        for frame in (
            'HELLO {"stream_id": 0, "extensions": ["system"]}',
            'GENERATE {"stream_id": 1, "model": "m", "prompt": [1]}',
        ):
            lines.put_nowait(frame)

        async def load():
            await asyncio.sleep(0.01)
            raise FileNotFoundError("model not found: /nowhere")

        async def send(text: str) -> None:
            out.append(text)

        with pytest.raises(FileNotFoundError):
            await serve_lines(load(), lines.get, send)
        return out

    records = [r for frame in asyncio.run(go()) for r in json.loads(frame.partition(" ")[2])]
    assert records[0]["hello"]["status"] == "loading"
    failed = [r for r in records if r.get("stream_id") == 1]
    assert failed == [{"stream_id": 1, "error": "model failed to load: model not found: /nowhere"}]
    assert records[-1]["system"]["event"] == "shutdown"
