"""ModelThread: the engine's single daemon worker, and the engine building on it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aioserve import AsyncEngine, SamplingParams
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine import async_engine
from aioserve.engine.model_thread import ModelThread
from aioserve.runner.model_runner import ModelRunner


def test_runs_jobs_in_order_on_one_daemon_thread():
    worker = ModelThread()
    names = [worker.submit(lambda i=i: (i, threading.current_thread())) for i in range(5)]
    results = [f.result(timeout=10) for f in names]
    assert [i for i, _ in results] == list(range(5))
    threads = {t for _, t in results}
    assert len(threads) == 1
    (thread,) = threads
    assert thread is not threading.current_thread() and thread.daemon
    worker.shutdown()
    assert not thread.is_alive()


def test_exceptions_reach_the_caller_and_the_thread_survives():
    worker = ModelThread()
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result(timeout=10)
    assert worker.submit(lambda: 42).result(timeout=10) == 42
    worker.shutdown()


def test_shutdown_refuses_new_jobs_and_can_cancel_queued_ones():
    worker = ModelThread()
    started, gate = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait(timeout=10)

    running = worker.submit(hold)
    assert started.wait(timeout=10)
    queued = worker.submit(lambda: "never")
    worker.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
    gate.set()
    assert running.result(timeout=10) is True
    assert queued.cancelled()


def test_engine_builds_and_steps_on_its_model_thread(monkeypatch, smollm2_gguf):
    threads = {"build": [], "step": []}
    real_build, real_execute = async_engine.build_engine, ModelRunner.execute

    def build(config):
        threads["build"].append(threading.current_thread())
        return real_build(config)

    def execute(self, step):
        threads["step"].append(threading.current_thread())
        return real_execute(self, step)

    monkeypatch.setattr(async_engine, "build_engine", build)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    engine = AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=str(smollm2_gguf), dtype="float32", max_model_len=256, enforce_eager=True
        )
    )

    async def generate() -> None:
        params = SamplingParams(max_tokens=3, temperature=0)
        async for _ in engine.generate("Hello", params, "r0"):
            pass
        await engine.shutdown()

    asyncio.run(generate())
    (build_thread,) = threads["build"]
    assert build_thread is not threading.main_thread()
    assert len(threads["step"]) == 3
    assert set(threads["step"]) == {build_thread}
    assert not build_thread.is_alive()
