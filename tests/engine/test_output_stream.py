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
