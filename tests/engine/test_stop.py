from __future__ import annotations

import random

import pytest

from tokenwire.engine.stop import StopStringMatcher


def feed_all(m: StopStringMatcher, chunks: list[str]) -> int | None:
    for ch in chunks:
        r = m.feed(ch)
        if r is not None:
            return r
    return None


def test_single_chunk_match_begin_index():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello STOP world") == 6
    assert m.match_end == 10 and m.matched == "STOP" and m.done


def test_stop_spanning_token_boundaries():
    m = StopStringMatcher(["</answer>"])
    chunks = ["The", " result", " is 4", "</", "ans", "wer", ">", " trailing"]
    assert feed_all(m, chunks) == len("The result is 4")
    assert m.match_end == len("The result is 4</answer>")


def test_one_character_chunks():
    text = "abc\n\nUser: hi"
    m = StopStringMatcher(["\n\nUser:"])
    idx = feed_all(m, list(text))
    assert idx == 3 and text[:idx] == "abc"


def test_multiple_stops_earliest_wins():
    m = StopStringMatcher(["world", "lo w"])
    # "lo w" ends at 7, "world" ends at 11
    assert m.feed("hello world") == 3
    assert m.matched == "lo w"


def test_same_end_prefers_longest():
    m = StopStringMatcher(["b", "ab"])
    assert m.feed("xab") == 1 and m.matched == "ab"


def test_earliest_end_independent_of_chunking():
    stops = ["abcd", "bc"]
    text = "zzabcdzz"
    whole = StopStringMatcher(stops).feed(text)
    for _ in range(20):
        cuts = sorted(random.Random(_).sample(range(1, len(text)), 3))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed_all(StopStringMatcher(stops), parts) == whole == 3


def test_no_false_positives():
    m = StopStringMatcher(["###", "END"])
    chunks = ["#", "#", " E", "N", "d", "ING ", "##", " #", "x##", "EN"]
    assert "###" not in "".join(chunks) and "END" not in "".join(chunks)
    assert feed_all(m, chunks) is None
    assert not m.done and m.total_len == sum(map(len, chunks))


def test_offsets_after_many_chunks():
    m = StopStringMatcher(["<|end|>"])
    chunks = ["word "] * 200 + ["<|", "end", "|>"]
    assert feed_all(m, chunks) == 5 * 200


def test_tail_window_is_bounded():
    m = StopStringMatcher(["abc", "xy"])
    for _ in range(1000):
        m.feed("zzzzzz")
    assert len(m._tail) <= 2
    assert m.feed("ab") is None and m.feed("c") == 6000


def test_after_match_returns_same_index():
    m = StopStringMatcher(["x"])
    assert m.feed("aax") == 2
    assert m.feed("x again") == 2


def test_safe_len_holds_back_partial_stop():
    m = StopStringMatcher(["</s>"])
    m.feed("hello <")
    assert m.safe_len == 6
    m.feed("/")
    assert m.safe_len == 6
    m.feed("x")
    assert m.safe_len == 9
    m.feed("</s")
    assert m.safe_len == 9
    m.feed(">")
    assert m.safe_len == 9 and m.match_start == 9


def test_no_stops_and_reset():
    m = StopStringMatcher([])
    assert m.feed("anything") is None and m.safe_len == 8
    m2 = StopStringMatcher(["q"])
    assert m2.feed("aq") == 1
    m2.reset()
    assert not m2.done and m2.feed("q") == 0


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_unicode():
    m = StopStringMatcher(["。\n"])
    assert feed_all(m, ["你好", "。", "\n", "x"]) == 2
