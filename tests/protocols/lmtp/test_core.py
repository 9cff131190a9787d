"""The sans-IO core with plain values: frames in, engine calls and frames out (no model, no I/O)."""

from __future__ import annotations

import pytest

from tests.protocols.lmtp.fakes import FakeEngine, Harness, records
from tokenwire.protocols.lmtp.codec import FrameError, decode_frame, encode_records
from tokenwire.protocols.lmtp.core import LmtpConnection

M = "fake-model"


def gen(sid=1, **kw):
    return {"stream_id": sid, "model": M, "prompt": [5, 6, 7], **kw}


# ---------------------------------------------------------------------- codec
def test_codec_splits_at_first_space_and_batches() -> None:
    assert decode_frame('GENERATE {"a": "b c"}') == ("GENERATE", {"a": "b c"})
    for bad in ("", "GENERATE", "GENERATE ", "GENERATE {nope", "GEN-ERATE {}", 'X {"a": NaN}'):
        with pytest.raises(FrameError):
            decode_frame(bad)
    frames = encode_records("TOKEN", [{"i": i} for i in range(5000)])
    assert len(frames) == 3 and all(f.startswith("TOKEN [") for f in frames)


# ---------------------------------------------------------------------- GENERATE
def test_generate_maps_fields_to_engine_options() -> None:
    h = Harness()
    assert (
        h.send(
            "GENERATE",
            gen(
                max_tokens=4,
                temperature=0.7,
                top_logprobs=3,
                top_p=0.9,
                top_k=5,
                seed=11,
                logit_bias={"9": 100, "10": -100.0},
            ),
        )
        == []
    )
    handle, _ = h.stream()
    assert handle.session is None and handle.append == [5, 6, 7]
    o = handle.options
    assert (o.max_tokens, o.top_logprobs, o.logprobs, o.logprob_mode) == (4, 3, True, "processed")
    s = o.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.logit_bias) == (
        0.7,
        0.9,
        5,
        11,
        {9: 100.0, 10: -100.0},
    )
    defaults = Harness()
    defaults.send("GENERATE", gen())
    o = defaults.stream()[0].options
    assert (o.max_tokens, o.sampling.temperature, o.top_logprobs, o.sampling.logit_bias) == (32, 0.0, 1, {})


def test_generate_records_and_last_token_carries_finish_reason() -> None:
    h = Harness()
    h.send("GENERATE", gen(max_tokens=3, top_logprobs=2))
    _, st = h.stream()
    h.token(st, 40, 3, -0.25, [(41, -0.1), (40, -0.25)])
    first = h.frames()
    assert first == [
        (
            "TOKEN",
            [
                {
                    "token": 40,
                    "stream_id": 1,
                    "logprob": -0.25,
                    "finish_reason": None,
                    "top_logprobs": {"40": -0.25, "41": -0.1},
                }
            ],
        )
    ]
    h.token(st, 41, 4)
    h.token(st, 42, 5, finish="length")  # max_tokens: the engine marks it the last; held until...
    assert [r["token"] for r in records(h.frames())] == [41]
    h.finish(st, "length", 3, 3)  # ... the FinishEvent
    last = records(h.frames())
    assert [(r["token"], r["finish_reason"]) for r in last] == [(42, "length")]
    assert h.conn.streams == {}


def test_eos_is_reported_as_stop_and_stream_id_is_freed() -> None:
    h = Harness()
    h.send("GENERATE", gen(sid="a"))
    _, st = h.stream()
    h.token(st, 2, 3, finish="eos")
    assert h.frames() == []
    h.finish(st, "eos", 3, 1)
    assert records(h.frames())[0]["finish_reason"] == "stop"
    h.send("GENERATE", gen(sid="a"))  # a finished stream_id may be used again
    assert len(h.watched) == 2


def test_records_of_streams_ready_together_share_one_frame() -> None:
    h = Harness()
    h.send("GENERATE", gen(1))
    h.send("GENERATE", gen(2))
    (_, a), (_, b) = h.watched
    h.conn.on_events([(a, _tok(10, 3)), (b, _tok(20, 3))])
    frames = h.frames()
    assert len(frames) == 1 and [r["stream_id"] for r in frames[0][1]] == [1, 2]


def _tok(token, position):
    from tokenwire.engine.request import TokenEvent

    return TokenEvent(token, position, False, -1.0, [(token, -1.0)])


def test_error_mid_stream_ends_it_with_an_error_record() -> None:
    h = Harness()
    h.send("GENERATE", gen())
    _, st = h.stream()
    h.token(st, 9, 3)
    h.finish(st, "error", error="model step failed: boom")
    out = records(h.frames())
    assert out[-1] == {"stream_id": 1, "error": "model step failed: boom"}


# ---------------------------------------------------------------------- SCORE and MODEL_INFO
def test_score_uses_raw_logprobs_of_the_scored_range_without_top_logprobs() -> None:
    h = Harness()
    h.send("SCORE", {"stream_id": 3, "model": M, "prompt": [1, 5], "scored": [6, 7], "logit_bias": {"6": 5}})
    handle, st = h.stream()
    assert handle.append == [1, 5, 6, 7]
    o = handle.options
    assert (o.max_tokens, list(o.logprob_ranges), o.logprob_mode, o.sampling.logit_bias) == (
        0,
        [(2, 4)],
        "raw",
        {},
    )
    h.token(st, 6, 2, -1.5, prefill=True)
    h.token(st, 7, 3, -2.5, prefill=True)
    h.finish(st, "length", 4, 0)
    assert records(h.frames()) == [
        {"token": 6, "stream_id": 3, "logprob": -1.5, "finish_reason": None},
        {"token": 7, "stream_id": 3, "logprob": -2.5, "finish_reason": "stop"},
    ]


def test_model_info_answers_with_a_msg_record() -> None:
    h = Harness()
    [(kind, [record])] = h.send("MODEL_INFO", {"stream_id": 7, "model": M, "data": {}})
    assert kind == "MSG" and record["stream_id"] == 7
    mi = record["model_info"]
    assert (mi["model"], mi["vocab_size"], mi["eos_token_id"], mi["context_length"]) == (M, 300, 2, 64)
    assert mi["tokenizer"]["name_or_path"] == "fake/chars" and mi["tokenizer"]["bos_token_id"] == 1


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("frame", "kind", "sid", "needle"),
    [
        ("nonsense", "MSG", None, "no JSON payload"),
        ("GENERATE {oops", "MSG", None, "not valid JSON"),
        ('FLY {"stream_id": 4}', "MSG", 4, "unknown message type 'FLY'"),
        ('GENERATE {"stream_id": 4, "model": "gpt2", "prompt": [1]}', "TOKEN", 4, "unknown model 'gpt2'"),
        ('GENERATE {"stream_id": 4, "model": "fake-model"}', "TOKEN", 4, "missing field 'prompt'"),
        ('GENERATE {"stream_id": 4, "prompt": [1]}', "TOKEN", 4, "missing field 'model'"),
        ('GENERATE {"model": "fake-model", "prompt": [1]}', "TOKEN", None, "missing field 'stream_id'"),
        (
            'GENERATE {"stream_id": true, "model": "fake-model", "prompt": [1]}',
            "TOKEN",
            None,
            "stream_id must",
        ),
        ('GENERATE {"stream_id": 4, "model": "fake-model", "prompt": "hi"}', "TOKEN", 4, "'text' extension"),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1, "x"]}',
            "TOKEN",
            4,
            "list of token ids",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "max_tokens": 0}',
            "TOKEN",
            4,
            ">= 1",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "temperature": -1}',
            "TOKEN",
            4,
            ">= 0",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "logit_bias": {"x": 1}}',
            "TOKEN",
            4,
            "not a token id",
        ),
        ('GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "top_p": 0}', "TOKEN", 4, "top_p"),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "repetition_penalty": 1.2}',
            "TOKEN",
            4,
            "unsupported field(s): repetition_penalty",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "buffer": "b"}',
            "TOKEN",
            4,
            "extension 'buffers' not negotiated",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1, 999]}',
            "TOKEN",
            4,
            "outside the vocab",
        ),
        (
            'GENERATE {"stream_id": 4, "model": "fake-model", "prompt": [1], "logit_bias": {"999": 1}}',
            "TOKEN",
            4,
            "outside the vocab",
        ),
        ('GENERATE {"stream_id": 4, "model": "fake-model", "prompt": []}', "TOKEN", 4, "nothing to run"),
        (
            'SCORE {"stream_id": 4, "model": "fake-model", "prompt": [1], "scored": []}',
            "TOKEN",
            4,
            "at least one",
        ),
        ('MODEL_INFO {"stream_id": 4, "model": "other"}', "MSG", 4, "unknown model"),
        ('BUFFER {"stream_id": 4, "name": "b"}', "MSG", 4, "extension 'buffers' not negotiated"),
        ("GENERATE [1, 2]", "TOKEN", None, "must be a JSON object"),
    ],
)
def test_bad_input_gives_an_error_record_and_the_connection_goes_on(frame, kind, sid, needle) -> None:
    engine = FakeEngine()
    if "nothing to run" in needle:  # the real engine's message for an empty sequence
        from tokenwire.engine.errors import InvalidTokenError

        def refuse(*_a, **_k):
            raise InvalidTokenError("nothing to run: the session and the appended tokens are empty")

        engine.generate = refuse  # type: ignore[method-assign]
    h = Harness(engine)
    h.conn.feed(frame)
    [(got_kind, [record])] = h.frames()
    assert got_kind == kind and record["stream_id"] == sid and needle in record["error"], record
    assert set(record) == {"stream_id", "error"}  # the seed's error record, nothing more
    if "nothing to run" not in needle:
        h.send("GENERATE", gen(99))  # still serving
        assert h.watched[-1][1].stream_id == 99


def test_duplicate_live_stream_id_is_refused_and_the_first_stream_goes_on() -> None:
    h = Harness()
    h.send("GENERATE", gen(5))
    _, first = h.stream()
    [(kind, [record])] = h.send("GENERATE", gen(5))
    assert kind == "TOKEN" and "already in use" in record["error"] and len(h.watched) == 1
    h.token(first, 8, 3)
    assert records(h.frames())[0]["token"] == 8


def test_prompt_filling_the_context_is_refused() -> None:
    h = Harness()
    [(_, [record])] = h.send("GENERATE", gen(prompt=list(range(3, 67))))
    assert "leaves no room" in record["error"]


def test_close_cancels_streams_and_frees_sessions() -> None:
    h = Harness()
    h.send("HELLO", {"extensions": ["buffers"]})
    h.send("BUFFER", {"stream_id": 2, "name": "b", "prompt": []})
    h.send("GENERATE", gen(3, buffer="b", prompt=[5]))
    handle, _ = h.stream()
    assert len(h.engine.sessions) == 2  # the buffer and the stream's fork
    h.conn.close()
    assert handle.cancelled and h.engine.sessions == {}
    h.conn.feed("GENERATE {}")  # ignored after close
    assert h.frames() == []


# ---------------------------------------------------------------------- parking while loading
def test_frames_wait_for_the_engine_and_system_clients_hear_loading_then_ready() -> None:
    h = Harness(ready=False)
    h.send("GENERATE", gen(1))
    [(_, [hello, loading])] = h.send("HELLO", {"stream_id": 0, "extensions": ["system"]})
    assert hello["hello"]["status"] == "loading" and loading["system"]["event"] == "loading"
    assert h.watched == []
    h.conn.set_engine(h.engine)  # type: ignore[arg-type]
    [(_, [ready])] = h.frames()
    assert ready["system"] == {"event": "ready", "model": M}
    assert len(h.watched) == 1


def test_an_unreadable_frame_whose_stream_id_is_a_lone_surrogate_is_answered_in_utf8() -> None:
    """Found by the fuzzer: the frame is refused for the surrogate, and its error record went to
    the stream_id read from the raw text, the surrogate itself, which UTF-8 cannot carry."""
    conn = LmtpConnection(None, lambda handle, stream: None)
    conn.feed('GENERATE {"stream_id": [], "model": [{"stream_id": "\\ud800"}], "prompt": [1]}')
    frames = conn.take_frames()
    assert len(frames) == 1 and "lone UTF-16 surrogate" in frames[0]
    frames[0].encode("utf-8")  # strict, as the WebSocket sends it
