"""OutputStream: the engine's per-request queue (one consumer)."""

from __future__ import annotations

import asyncio

import pytest

from aioserve.engine.output_stream import OutputStream


def test_items_come_out_in_order_whether_or_not_the_consumer_waits():
    async def scenario():
        stream = OutputStream()
        stream.put_nowait(1)
        stream.put_nowait(2)
        waiting = asyncio.create_task(collect(stream, 3))
        await asyncio.sleep(0)
        stream.put_nowait(3)
        return await waiting

    async def collect(stream, count):
        return [await stream.get() for _ in range(count)]

    assert asyncio.run(scenario()) == [1, 2, 3]


def test_a_consumer_cancelled_while_waiting_loses_nothing():
    async def scenario():
        stream = OutputStream()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.get(), timeout=0.01)
        stream.put_nowait("kept")
        assert stream.qsize() == 1
        return await asyncio.wait_for(stream.get(), timeout=1)

    assert asyncio.run(scenario()) == "kept"


def test_get_nowait_on_an_empty_stream_raises_queue_empty():
    stream = OutputStream()
    assert stream.empty()
    with pytest.raises(asyncio.QueueEmpty):
        stream.get_nowait()


def test_news_not_yet_taken_becomes_one_output_built_when_taken():
    built = []

    def build():
        built.append(len(built))
        return f"output {built[-1]}"

    async def scenario():
        stream = OutputStream(build)
        stream.notify()
        stream.notify()  # the consumer has not taken the first news: nothing more is queued
        assert stream.qsize() == 1 and built == []
        first = await stream.get()
        stream.notify()
        stream.put_nowait(ValueError("the end"))
        return first, await stream.get(), await stream.get()

    first, second, error = asyncio.run(scenario())
    assert (first, second) == ("output 0", "output 1")
    assert isinstance(error, ValueError)
    assert built == [0, 1]


def test_news_that_amounts_to_no_output_is_skipped():
    outputs = iter([None, "due"])

    async def scenario():
        stream = OutputStream(lambda: next(outputs))
        stream.notify()
        with pytest.raises(asyncio.QueueEmpty):
            stream.get_nowait()
        stream.notify()
        return await asyncio.wait_for(stream.get(), timeout=1)

    assert asyncio.run(scenario()) == "due"
