"""StepWaiter: the engine loop lets the event loop's other tasks run while a step is on the
model thread, and runs ahead of them, for a bounded time, while the steps are done already."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from aioserve.engine.steps_in_flight import StepInFlight, StepWaiter


def step_with(future: Future) -> StepInFlight:
    return StepInFlight(0, None, future, threading.Event(), None)


def done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_a_done_step_is_taken_without_letting_others_run_until_the_limit():
    async def scenario():
        waiter = StepWaiter(run_ahead_s=60)
        others: list[str] = []
        asyncio.get_running_loop().call_soon(others.append, "consumer")
        results = [await waiter.result(step_with(done(i))) for i in range(3)]
        ran_while_ahead = list(others)
        waiter.run_ahead_s = 0  # the limit is reached: the others get their turn first
        results.append(await waiter.result(step_with(done(3))))
        return results, ran_while_ahead, others

    results, ran_while_ahead, others = asyncio.run(scenario())
    assert results == [0, 1, 2, 3]
    assert ran_while_ahead == []
    assert others == ["consumer"]


def test_a_running_step_is_awaited_and_others_run_meanwhile():
    async def scenario():
        waiter = StepWaiter(run_ahead_s=60)
        future: Future = Future()
        others: list[str] = []

        def finish_later() -> None:
            time.sleep(0.02)
            future.set_result("tokens")

        threading.Thread(target=finish_later).start()
        asyncio.get_running_loop().call_soon(others.append, "consumer")
        return await waiter.result(step_with(future)), others

    assert asyncio.run(scenario()) == ("tokens", ["consumer"])


def test_a_failed_step_raises_its_error():
    async def scenario():
        future: Future = Future()
        future.set_exception(RuntimeError("device lost"))
        return await StepWaiter().result(step_with(future))

    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(scenario())
