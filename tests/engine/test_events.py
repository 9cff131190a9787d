"""EventFeed and EventChannel (engine/events.py): order, batching, close, cross-thread delivery."""

from __future__ import annotations

import asyncio
import threading

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


def test_channel_delivers_in_order_with_one_wakeup_per_batch() -> None:
    async def main() -> tuple[list[list[int]], int]:
        channel: EventChannel[int] = EventChannel()
        wakeups = 0
        schedule = channel.loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return schedule(callback, *args)

        channel.loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            for i in range(5):  # one burst: the loop does not run in between
                channel.push(i)
            first = await channel.get()
            channel.push_all([5, 6])
            second = await channel.get()
        finally:
            del channel.loop.call_soon_threadsafe
        return [first, second], wakeups

    batches, wakeups = asyncio.run(main())
    assert batches == [[0, 1, 2, 3, 4], [5, 6]]
    assert wakeups == 2


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
