"""The engine's health: whose fault a failed step is, a lost model thread, a bounded shutdown.

Engines here run around the stand-in runner on the test's own event loop; the HTTP side of
the same cases is in tests/server/test_engine_death.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from aioserve.engine.async_engine import AsyncEngine, EngineDeadError
from aioserve.engine.health import MAX_FAILED_STEPS_IN_A_ROW, StepFailures
from tests.server.test_systemd_notify import HangingStep, consume, stand_in_engine


def test_only_fresh_failures_count_towards_the_engines_death():
    failures = StepFailures()
    first, collateral = failures.launch(), failures.launch()
    failures.failed(first, RuntimeError("bad"), "step")
    failures.failed(collateral, RuntimeError("fallout"), "step")  # launched before: not counted
    assert failures.in_a_row == 1
    failures.completed()
    for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        failures.failed(failures.launch(), RuntimeError("bad"), "step")
    with pytest.raises(EngineDeadError, match="model steps in a row failed"):
        failures.failed(failures.launch(), RuntimeError("bad"), "step")


@pytest.mark.parametrize("error", [MemoryError(), SystemExit(3), EngineDeadError("gone")])
def test_a_fatal_error_kills_at_once(error):
    failures = StepFailures()
    with pytest.raises(EngineDeadError) as raised:
        failures.failed(failures.launch(), error, "a model step failed")
    assert raised.value.__cause__ is error


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_lost_model_thread_kills_the_engine():
    engine = stand_in_engine()

    async def scenario() -> None:
        try:
            await consume(engine, "before", max_tokens=4)
            assert engine.health_problem() is None
            engine._model_thread._jobs.put("not a job")  # the thread dies of it
            engine._model_thread._thread.join(timeout=10)
            assert engine.is_dead
            assert engine.health_problem() == "the model thread is gone"
            with pytest.raises(EngineDeadError, match="ended unexpectedly"):
                await consume(engine, "after", max_tokens=4)
        finally:
            await engine.shutdown(timeout=1)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_shutdown_leaves_a_hung_step_behind_after_its_timeout(caplog):
    engine = stand_in_engine()
    hanging = HangingStep(engine.runner)
    engine.runner.execute = hanging

    async def scenario() -> float:
        request = asyncio.create_task(consume(engine, "stuck", max_tokens=100))
        hanging.hang.set()
        while not hanging.entered.is_set():
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await engine.shutdown(timeout=0.5)
        took = time.monotonic() - started
        await asyncio.gather(request, return_exceptions=True)
        return took

    try:
        took = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        hanging.release()
    assert 0.5 <= took < 2
    assert any("leaving it behind" in r.getMessage() for r in caplog.records)


def test_an_idle_engine_is_healthy_however_long_it_waits():
    engine: AsyncEngine = stand_in_engine()
    engine.loop_clock.floor = 0.2

    async def scenario() -> str | None:
        try:
            await consume(engine, "one", max_tokens=4)
            await asyncio.sleep(0.5)
            return engine.health_problem()
        finally:
            await engine.shutdown(timeout=1)

    assert asyncio.run(scenario()) is None
