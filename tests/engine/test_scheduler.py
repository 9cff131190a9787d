"""The scheduler under KV pressure: a more urgent request preempts a less urgent running one."""

from __future__ import annotations

import threading

from tests.engine.test_engine_parity import GREEDY, make_engine, rand_tokens
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import GenerateOptions, Request, TokenEvent, iter_events
from tokenwire.engine.scheduler import Scheduler
from tokenwire.engine.session import Session
from tokenwire.model.config import ModelConfig

TINY = ModelConfig("LlamaForCausalLM", 100, 8, 16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)


def _request(rid: int, tokens: int, priority: int) -> Request:
    # tokens of its own: the requests share no prefix, so the scheduler's prefix-cache lookup
    # (up to the request's positions.recompute_from) reuses nothing and each needs its own blocks
    session = Session(f"s{rid}", tokens=list(range(rid * 100, rid * 100 + tokens)))
    return Request(rid, session, GenerateOptions(max_tokens=8, priority=priority), tokens)


def _failures() -> tuple[list[tuple[int, str]], object]:
    failed: list[tuple[int, str]] = []
    return failed, lambda request, error: failed.append((request.id, error))


def test_an_urgent_prefill_preempts_a_decoding_batch_request() -> None:
    kv = KVCache(TINY, 4, 4, "fp32", "cpu")  # 16 positions
    scheduler = Scheduler(kv, max_batch_tokens=64, max_running=8, idle_sessions=list)
    failed, fail = _failures()
    batch = _request(1, 10, priority=10)
    scheduler.add(batch)
    [item] = scheduler.schedule(fail)
    assert item.request is batch and item.count == 10
    batch.session.computed(10, kv)
    batch.session.tokens.append(50)  # sampled: now decoding, 3 of 4 blocks held
    urgent = _request(2, 8, priority=0)  # needs 2 blocks, 1 is free
    scheduler.add(urgent)
    items = scheduler.schedule(fail)
    assert [(i.request.id, i.count) for i in items] == [(2, 8)]
    assert batch.session.block_table == [] and batch.session.num_computed == 0  # released
    assert not batch.started and batch in scheduler.running  # recomputed when there is room
    assert failed == []


def test_equal_priority_never_preempts_and_a_request_too_big_for_the_cache_fails() -> None:
    kv = KVCache(TINY, 4, 4, "fp32", "cpu")
    scheduler = Scheduler(kv, max_batch_tokens=64, max_running=8, idle_sessions=list)
    failed, fail = _failures()
    first = _request(1, 10, priority=5)
    scheduler.add(first)
    scheduler.schedule(fail)
    first.session.computed(10, kv)
    first.session.tokens.append(50)
    second = _request(2, 8, priority=5)
    scheduler.add(second)
    assert [i.request.id for i in scheduler.schedule(fail)] == [1]  # the second waits its turn
    assert first.session.block_table and second.session.block_table == []
    huge = _request(3, 30, priority=0)  # 8 blocks: more than the whole cache
    scheduler.add(huge)
    assert [i.request.id for i in scheduler.schedule(fail)] == [1]  # no pointless preemption
    assert first.session.block_table and failed == []
    scheduler.remove(first)
    scheduler.remove(second)
    first.session.release(kv)
    assert scheduler.schedule(fail) == []  # alone, it cannot fit: it fails
    assert [rid for rid, _ in failed] == [3] and "KV cache budget exhausted" in failed[0][1]


def test_preempted_request_finishes_after_the_urgent_one_with_the_same_tokens(tokenizer) -> None:
    """End to end: the batch request is preempted mid-decode, recomputed, and its greedy output
    is what it is without contention."""
    probe, _ = make_engine("smollm2", tokenizer)
    per_block = KVCache.bytes_per_block(probe.config, 16, "fp32")
    probe.shutdown()
    engine, _ = make_engine("smollm2", tokenizer, kv_cache_mb=8 * per_block / 2**20)  # 8 blocks
    assert engine.kv.num_blocks == 8
    try:
        batch_prompt, urgent_prompt = rand_tokens(40, 70), rand_tokens(90, 71)
        batch_opts = GenerateOptions(max_tokens=60, ignore_eos=True, sampling=GREEDY, priority=10)
        alone = [e.token_id for e in engine.generate(None, batch_prompt, batch_opts).result()[0]]
        done: list[str] = []
        batch = engine.generate(None, batch_prompt, batch_opts)
        events = iter_events(batch)
        first = next(events)  # decoding now, holding 3 blocks; the urgent prompt needs 6
        rest: list[int] = []

        def read_rest() -> None:
            rest.extend(e.token_id for e in events if isinstance(e, TokenEvent))
            done.append("batch")

        reader = threading.Thread(target=read_rest)
        reader.start()
        urgent_opts = GenerateOptions(max_tokens=4, ignore_eos=True, sampling=GREEDY, priority=0)
        _, finish = engine.generate(None, urgent_prompt, urgent_opts).result()
        done.append("urgent")
        reader.join(timeout=60)
        assert finish.reason == "length"
        assert done == ["urgent", "batch"]
        assert [first.token_id, *rest] == alone
    finally:
        engine.shutdown()


def _fairness_setup(share: str) -> tuple[Scheduler, KVCache, Request, Request, Request]:
    kv = KVCache(TINY, 4, 256, "fp32", "cpu")  # 1,024 positions
    scheduler = Scheduler(kv, max_batch_tokens=64, max_running=8, idle_sessions=list, prefill_share=share)
    decoding = _request(1, 4, priority=2)
    scheduler.add(decoding)
    scheduler.schedule(lambda r, e: None)
    decoding.session.computed(4, kv)
    decoding.session.tokens.append(7)  # sampled: decoding from now on
    long = _request(2, 500, priority=2)  # a long prompt, then a short one after it
    short = _request(3, 5, priority=2)
    scheduler.add(long)
    scheduler.add(short)
    return scheduler, kv, decoding, long, short


def test_prompts_share_the_step_so_a_short_one_is_read_beside_a_long_one() -> None:
    """Issue 41: the decode row runs, the short prompt (after the long one) is read whole in
    the same step, and the long one takes the rest of the budget."""
    scheduler, _, decoding, long, short = _fairness_setup("fair")
    items = {i.request.id: i.count for i in scheduler.schedule(lambda r, e: None)}
    assert items == {decoding.id: 1, long.id: 64 - 1 - 5, short.id: 5}


def test_arrival_order_lets_the_long_prompt_take_the_whole_step() -> None:
    """The old policy (the fairness bench's baseline): the short prompt waits behind every chunk."""
    scheduler, _, decoding, long, _ = _fairness_setup("arrival")
    items = {i.request.id: i.count for i in scheduler.schedule(lambda r, e: None)}
    assert items == {decoding.id: 1, long.id: 63}


def test_long_prompts_split_the_step_evenly() -> None:
    from tokenwire.engine.scheduler import _fair_share

    kv = KVCache(TINY, 4, 256, "fp32", "cpu")
    scheduler = Scheduler(kv, max_batch_tokens=90, max_running=8, idle_sessions=list)
    requests = [_request(i, n, priority=0) for i, n in ((1, 400), (2, 300), (3, 10))]
    for r in requests:
        scheduler.add(r)
    items = {i.request.id: i.count for i in scheduler.schedule(lambda r, e: None)}
    assert items == {1: 40, 2: 40, 3: 10}  # 10 for the short one, (90 - 10) / 2 each for the rest
    assert _fair_share(requests, requests[0], 2) == 1  # fewer tokens than prompts: one each
