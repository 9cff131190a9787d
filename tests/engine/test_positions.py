"""PositionOutputs with plain values: which positions owe logprobs and readouts, the rows a
chunk keeps for them, and their results handed back once each."""

from __future__ import annotations

import random

from tokenwire.engine.positions import PositionOutputs, PromptOutput, Spans
from tokenwire.engine.request import TokenEvent


def test_spans_merge_clip_and_answer_windows() -> None:
    spans = Spans([(8, 12), (2, 4), (3, 6), (6, 7), (20, 20), (30, 40)], lo=1, hi=35)
    assert spans.intervals() == [(2, 7), (8, 12), (30, 35)]  # overlapping and touching merged
    assert [p for p in range(45) if p in spans] == [*range(2, 7), *range(8, 12), *range(30, 35)]
    assert list(spans.within(5, 9)) == [5, 6, 8]
    assert list(spans.within(12, 30)) == []
    assert list(spans.within(0, 100)) == [p for p in range(100) if p in spans]
    assert spans.first() == 2
    assert not Spans([(5, 5), (7, 3)]) and Spans([]).first() is None


def test_ranges_may_come_as_lists() -> None:
    positions = PositionOutputs(10, [[2, 4]], readout_ranges=[[3, 6], (1, 2)])  # type: ignore[list-item]
    assert [done.position for done in positions.prompt_done(10)] == [1, 2, 3, 4, 5]


def test_recompute_starts_before_the_first_position_that_owes_something() -> None:
    assert PositionOutputs(10).recompute_from == 9  # only the last row, to sample from
    assert PositionOutputs(10, [(3, 5)]).recompute_from == 2  # position 3's logprob: row 2's logits
    assert PositionOutputs(10, readout_ranges=[(4, 6)]).recompute_from == 4  # its own hidden state
    assert PositionOutputs(10, [(6, 8)], readout_ranges=[(5, 6)]).recompute_from == 5
    assert PositionOutputs(10, [(0, 2)]).recompute_from == 0
    # ranges past the prompt concern generated positions only
    assert PositionOutputs(10, [(12, 20)], readout_ranges=[(15, 16)]).recompute_from == 9


def test_a_prompt_logprob_row_serves_the_next_chunk_and_is_handed_out_once() -> None:
    positions = PositionOutputs(10, [(2, 5)])
    first = positions.rows(0, 4, 10)
    # positions 2, 3, 4 take rows 1, 2, 3: the chunk's last row serves position 4 of the next
    assert first.prompt_logprobs == [1, 2, 3] and first.logits == [1, 2, 3]
    assert first.sample is None and first.capture == []
    for q in first.prompt_logprobs:
        positions.store_prompt_logprob(q + 1, (-float(q + 1), None))
    assert positions.prompt_done(4) == [
        PromptOutput(2, (-2.0, None), False),
        PromptOutput(3, (-3.0, None), False),
    ]
    last = positions.rows(4, 10, 10)
    assert last.prompt_logprobs == [] and last.sample == 9 and last.logits == [9]
    assert positions.prompt_done(10) == [PromptOutput(4, (-4.0, None), False)]
    assert positions.prompt_done(10) == []


def test_position_zero_owes_an_event_without_a_logprob() -> None:
    positions = PositionOutputs(4, [(0, 2)])
    rows = positions.rows(0, 4, 4)
    assert rows.prompt_logprobs == [0] and rows.logits == [0, 3]  # row 0 for position 1 only
    positions.store_prompt_logprob(1, (-1.0, [(7, -0.5)]))
    assert positions.prompt_done(4) == [
        PromptOutput(0, None, False),
        PromptOutput(1, (-1.0, [(7, -0.5)]), False),
    ]


def test_the_sampling_row_is_kept_once() -> None:
    positions = PositionOutputs(10, [(4, 5)])
    rows = positions.rows(0, 4, 4)  # row 3 serves position 4 and is the sequence's last row
    assert rows.prompt_logprobs == [3] and rows.sample == 3 and rows.logits == [3]


def test_recomputation_after_preemption_keeps_no_row_for_what_went_out() -> None:
    positions = PositionOutputs(12, [(1, 12)], readout_ranges=[(0, 12)])
    rows = positions.rows(0, 6, 12)
    assert rows.prompt_logprobs == [0, 1, 2, 3, 4, 5] and rows.capture == [0, 1, 2, 3, 4, 5]
    for q in rows.prompt_logprobs:
        positions.store_prompt_logprob(q + 1, (0.0, None))
    assert [done.position for done in positions.prompt_done(6)] == [0, 1, 2, 3, 4, 5]
    again = positions.rows(0, 12, 12)  # the KV was released: the whole prompt runs again
    assert again.prompt_logprobs == [5, 6, 7, 8, 9, 10]  # position 6 on: 6's logprob already stored
    assert again.capture == [6, 7, 8, 9, 10, 11] and again.logits == [5, 6, 7, 8, 9, 10, 11]
    done = positions.prompt_done(12)
    assert [d.position for d in done] == list(range(6, 12)) and all(d.readout for d in done)
    assert done[0].logprob == (0.0, None) and done[1].logprob is None  # 7's never stored here


def test_generated_logprobs_every_one_or_the_ranges() -> None:
    assert all(PositionOutputs(5, None, logprobs=True).wants_logprob(p) for p in range(5, 50))
    assert not any(PositionOutputs(5, None, logprobs=False).wants_logprob(p) for p in range(5, 50))
    ranged = PositionOutputs(5, [(6, 8)], logprobs=True)
    assert [p for p in range(5, 12) if ranged.wants_logprob(p)] == [6, 7]
    # ranges given, even empty: exactly what they cover, whatever `logprobs` says
    assert not any(PositionOutputs(5, [], logprobs=True).wants_logprob(p) for p in range(5, 50))
    assert PositionOutputs(5, [(5, 6)], logprobs=False).wants_logprob(5)


def _event(position: int) -> TokenEvent:
    return TokenEvent(100 + position, position, False)


def test_generated_readouts_wait_for_their_hidden_state() -> None:
    positions = PositionOutputs(5, readout_ranges=[(2, 3), (6, 8)])
    assert [p for p in range(5, 10) if positions.wants_readout(p)] == [6, 7]
    assert positions.rows(0, 5, 5).capture == [2]
    positions.prompt_done(5)
    assert not positions.waiting and positions.generated_done(10) == []
    six, seven = _event(6), _event(7)
    positions.defer(six)  # forced tokens: two appended before the next step
    positions.defer(seven)
    positions.finish_after_readouts = ("stop", "constraint")
    assert positions.waiting
    rows = positions.rows(5, 8, 8)
    assert rows.capture == [6, 7] and rows.sample == 7
    assert positions.rows(5, 7, 8).capture == [6]  # a chunk holds only its own positions
    assert positions.generated_done(7) == [six]
    assert positions.generated_done(8) == [seven] and not positions.waiting
    assert positions.finish_after_readouts == ("stop", "constraint")


def _covers(ranges: list[tuple[int, int]], p: int) -> bool:
    return any(start <= p < end for start, end in ranges)


def _random_ranges(rng: random.Random, limit: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(rng.randrange(4)):
        start = rng.randrange(limit)
        out.append((start, start + rng.randrange(limit // 2)))
    return out


def test_rows_and_events_match_the_per_position_definitions() -> None:
    """Random ranges and chunkings (with restarts, as after preemption) against the plain
    per-position rules: a prompt position owes an event when a range covers it; its logprob
    comes from the row before it, its readout from its own row; nothing goes out twice."""
    rng = random.Random(30)
    for _ in range(300):
        prompt_len = rng.randrange(1, 40)
        lp = _random_ranges(rng, prompt_len + 5)
        ro = _random_ranges(rng, prompt_len + 5)
        positions = PositionOutputs(prompt_len, lp or None, readout_ranges=ro)
        owed = [p for p in range(prompt_len) if _covers(lp, p) or _covers(ro, p)]
        first = min([prompt_len - 1, *(p - 1 if _covers(lp, p) and p > 0 else p for p in owed)])
        assert positions.recompute_from == max(first, 0)
        out: list[int] = []
        stored: set[int] = set()
        start = rng.randrange(positions.recompute_from + 1)
        while start < prompt_len:
            end = min(prompt_len, start + rng.randrange(1, 12))
            rows = positions.rows(start, end, prompt_len)
            pending = [p for p in owed if p not in out]
            want_lp = [p - 1 for p in pending if p > 0 and _covers(lp, p) and start <= p - 1 < end]
            assert rows.prompt_logprobs == want_lp
            assert rows.capture == [p for p in pending if _covers(ro, p) and start <= p < end]
            assert rows.sample == (end - 1 if end == prompt_len else None)
            assert rows.logits == sorted(set(want_lp) | ({end - 1} if end == prompt_len else set()))
            for q in rows.prompt_logprobs:
                positions.store_prompt_logprob(q + 1, (float(q + 1), None))
                stored.add(q + 1)
            done = positions.prompt_done(end)
            assert [d.position for d in done] == [p for p in pending if p < end]
            for d in done:
                assert d.readout == _covers(ro, d.position)
                assert d.logprob == ((float(d.position), None) if d.position in stored else None)
            out += [d.position for d in done]
            start = end if rng.random() < 0.8 else rng.randrange(positions.recompute_from + 1)  # preempted
        assert out == owed
        assert all(_covers(lp, p) for p in stored) and all(p in out for p in stored)
