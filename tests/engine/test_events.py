"""EventFeed and EventChannel (engine/events.py): order, batching, close, cross-thread delivery."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenwire.engine.events import EventChannel, EventFeed


def test_feed_hands_parked_events_over_first_then_passes_new_ones_on() -> None:
    feed: EventFeed[int] = EventFeed()
    feed.push_all([1, 2])
    got: list[int] = []
    feed.subscribe(got.append)
    assert got == [1, 2]
    feed.push(3)
    assert got == [1, 2, 3]


def test_feed_takes_one_subscriber() -> None:
    feed: EventFeed[int] = EventFeed()
    feed.subscribe(lambda _: None)
    with pytest.raises(RuntimeError, match="already have a subscriber"):
        feed.subscribe(lambda _: None)


def test_feed_keeps_order_when_subscribing_while_another_thread_pushes() -> None:
    feed: EventFeed[int] = EventFeed()
    got: list[int] = []
    half = threading.Event()

    def produce() -> None:
        for i in range(20_000):
            feed.push(i)
            if i == 10_000:
                half.set()

    producer = threading.Thread(target=produce)
    producer.start()
    half.wait()
    feed.subscribe(got.append)
    producer.join()
    assert got == list(range(20_000))


def _count_wakeups(channel: EventChannel[int]) -> list[int]:
    """Count the channel's loop wake-ups (its call_soon_threadsafe calls) in the returned list."""
    count = [0]
    schedule = channel.loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        count[0] += 1
        return schedule(callback, *args)

    channel.loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return count


def test_channel_wakes_the_loop_only_for_a_waiting_consumer() -> None:
    async def main() -> tuple[list[list[int]], list[int]]:
        channel: EventChannel[int] = EventChannel()
        wakeups = _count_wakeups(channel)
        try:
            for i in range(5):  # nobody waits yet: queued, no wake-up
                channel.push(i)
            first = await channel.get()  # takes them without waiting
            channel.push_all([5, 6])  # the consumer is busy (not in get): no wake-up either
            second = await channel.get()
            seen = [wakeups[0]]
            reader = asyncio.ensure_future(channel.get())
            await asyncio.sleep(0)  # the reader parks
            pusher = threading.Thread(target=lambda: [channel.push(i) for i in range(7, 10)])
            pusher.start()
            pusher.join()  # all three pushed before the loop runs again: one wake-up carries them
            third = await reader
            seen.append(wakeups[0])
        finally:
            del channel.loop.call_soon_threadsafe
        return [first, second, third], seen

    batches, wakeups = asyncio.run(main())
    assert batches == [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert wakeups == [0, 1]


def test_slow_consumer_gets_every_item_in_order_with_at_most_one_wakeup_per_wait() -> None:
    count = 3_000

    async def main() -> tuple[list[int], int, int]:
        channel: EventChannel[int] = EventChannel()
        wakeups = _count_wakeups(channel)

        def produce() -> None:
            for i in range(count):
                channel.push(i)
                if i % 100 == 0:
                    time.sleep(0.001)  # bursts, as engine steps come
            channel.close()

        producer = threading.Thread(target=produce)
        got: list[int] = []
        gets = 0
        try:
            producer.start()
            async for batch in channel:  # ends once closed and drained
                gets += 1
                got.extend(batch)
                await asyncio.sleep(0.002)  # a slow client: the producer runs ahead meanwhile
            producer.join()
        finally:
            del channel.loop.call_soon_threadsafe
        return got, gets, wakeups[0]

    got, gets, wakeups = asyncio.run(main())
    assert got == list(range(count))  # none lost, none doubled, in order, and the stream ended
    assert gets < count  # the slow consumer took items in batches, not one by one
    assert wakeups <= gets + 1  # one per wait at most (+1: the close), never one per item


def test_channel_carries_items_from_another_thread_in_order() -> None:
    count = 5_000

    async def main() -> list[int]:
        channel: EventChannel[int] = EventChannel()
        producer = threading.Thread(target=lambda: [channel.push(i) for i in range(count)])
        producer.start()
        got: list[int] = []
        while len(got) < count:
            got.extend(await asyncio.wait_for(channel.get(), 10))
        producer.join()
        return got

    assert asyncio.run(main()) == list(range(count))


def test_channel_calls_on_batch_on_the_loop_thread() -> None:
    async def main() -> tuple[list[list[str]], set[int]]:
        batches: list[list[str]] = []
        threads: set[int] = set()
        done = asyncio.Event()

        def on_batch(batch: list[str]) -> None:
            threads.add(threading.get_ident())
            batches.append(batch)
            if "end" in batch:
                done.set()

        channel: EventChannel[str] = EventChannel(on_batch=on_batch)
        pusher = threading.Thread(target=lambda: channel.push_all(["a", "b", "end"]))
        pusher.start()
        await asyncio.wait_for(done.wait(), 10)
        pusher.join()
        return batches, threads

    batches, threads = asyncio.run(main())
    assert [item for batch in batches for item in batch] == ["a", "b", "end"]
    assert threads == {threading.get_ident()}  # asyncio.run's loop runs on this thread


def test_closed_channel_delivers_what_it_had_then_ends_and_drops_later_pushes() -> None:
    async def main() -> tuple[list[list[int]], list[int]]:
        channel: EventChannel[int] = EventChannel()
        channel.push_all([1, 2])
        channel.close()
        channel.push(3)  # after close: dropped
        batches = [batch async for batch in channel]
        return batches, await channel.get()

    batches, after = asyncio.run(main())
    assert batches == [[1, 2]]
    assert after == []


def test_close_wakes_a_waiting_reader() -> None:
    async def main() -> list[int]:
        channel: EventChannel[int] = EventChannel()
        reader = asyncio.ensure_future(channel.get())
        await asyncio.sleep(0)
        threading.Thread(target=channel.close).start()
        return await asyncio.wait_for(reader, 10)

    assert asyncio.run(main()) == []


def test_push_to_a_closed_loop_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    channel: EventChannel[int] = EventChannel(loop)
    loop.close()
    channel.push(1)  # the consumer's loop is gone: nobody listens, nothing raises
    assert channel.take() == [1]


def test_a_consumer_that_leaves_early_stops_the_producer(smollm2_engine) -> None:  # type: ignore[no-untyped-def]
    """stream_events over the real engine: the consumer takes three tokens and leaves (a client
    that went away); the request is cancelled at once, not generated to its 2,000 tokens."""
    from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent, stream_events

    engine = smollm2_engine
    prompt = engine.tokenizer.encode("Count from one to one thousand, in words:")
    options = GenerateOptions(max_tokens=2000, ignore_eos=True, sampling=SamplingParams(temperature=0.0))

    async def main() -> tuple[list[int], object]:
        handle = engine.generate(None, prompt, options)
        stream = stream_events(handle)
        got: list[int] = []
        async for event in stream:
            assert isinstance(event, TokenEvent)
            got.append(event.token_id)
            if len(got) == 3:
                break
        await stream.aclose()  # what Starlette does with a response body whose client left
        return got, handle

    got, handle = asyncio.run(main())
    assert len(got) == 3
    assert handle.finished  # type: ignore[attr-defined]
    assert handle.generated < options.max_tokens  # type: ignore[attr-defined]
    assert engine.stats()["running"] == 0
