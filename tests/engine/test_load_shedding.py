"""Load shedding in the engine: vLLM's queue caps, reservations, and the offline path.

An engine around the stand-in runner, on the test's own event loop. The expected
boundaries are those of vLLM's own tests of the caps (PR #49445): a request is refused when
the sequences in flight plus its n exceed --max-num-queued-reqs, and while the prefill
backlog is at or above --max-num-queued-tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.load_shedding import QueueFullError
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.runner.stand_in_runner import StandInRunner

VOCAB = 64
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def stand_in_engine(**caps: int) -> AsyncEngine:
    runner = StandInRunner(VOCAB, step_seconds=0.005)
    parts = engine_parts_around(
        runner, vocab_size=VOCAB, num_blocks=64, max_model_len=256, async_scheduling=False, **caps
    )
    return AsyncEngine(parts)


def params(n: int = 1, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=0, detokenize=False)


async def consume(engine: AsyncEngine, request_id: str, n: int = 1, max_tokens: int = 4) -> None:
    async for _ in engine.generate(PROMPT, params(n, max_tokens), request_id):
        pass


async def refused(engine: AsyncEngine, request_id: str, n: int = 1) -> str:
    """The reason `generate` refuses the request; fails if it is admitted."""
    with pytest.raises(QueueFullError) as error:
        await anext(engine.generate(PROMPT, params(n), request_id))
    return error.value.reason


def assert_idle(engine: AsyncEngine) -> None:
    assert engine.num_unfinished_requests == 0
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.load_shedder.num_reserved == 0


def test_the_request_cap_counts_every_sample_and_registers_nothing_it_refuses():
    engine = stand_in_engine(max_num_queued_reqs=4)

    async def scenario() -> None:
        first = asyncio.create_task(consume(engine, "a", n=3, max_tokens=200))
        await asyncio.sleep(0)  # registered: 3 sequences in flight
        assert await refused(engine, "b", n=2) == "max_num_queued_reqs"
        assert engine.num_unfinished_requests == 1
        await consume(engine, "c", n=1)  # 3 + 1 = 4: at the cap, admitted
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await consume(engine, "d", n=4)  # alone again: 4 fit
        assert await refused(engine, "e", n=5) == "max_num_queued_reqs"
        await engine.shutdown()

    asyncio.run(scenario())
    assert engine.load_shedder.rejections == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 0}
    assert_idle(engine)


def test_the_token_cap_refuses_while_the_prefill_backlog_is_at_it():
    engine = stand_in_engine(max_num_queued_tokens=4)

    async def scenario() -> None:
        first = asyncio.create_task(consume(engine, "a", max_tokens=200))
        await asyncio.sleep(0)
        # The whole prompt of "a" counts until its first token, whatever its own length.
        assert engine.scheduler.num_prefill_tokens == 4
        assert await refused(engine, "b") == "max_num_queued_tokens"
        while engine.scheduler.num_prefill_tokens:
            await asyncio.sleep(0.001)
        await consume(engine, "c")  # "a" decodes: the backlog is empty again
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await engine.shutdown()

    asyncio.run(scenario())
    assert engine.load_shedder.rejections == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 1}
    assert_idle(engine)


def test_reserved_places_count_as_in_flight_until_released():
    engine = stand_in_engine(max_num_queued_reqs=4)
    shedder = engine.load_shedder
    with shedder.reserve(3) as reservation:
        assert shedder.num_in_flight == 3
        with pytest.raises(QueueFullError):
            shedder.reserve(2)
        reservation.release(1)
        shedder.reserve(2).release()
        assert shedder.num_in_flight == 2
    assert shedder.num_reserved == 0
    reservation.release()  # releasing again gives back nothing more
    assert shedder.num_reserved == 0


def test_without_caps_nothing_is_refused():
    engine = stand_in_engine()

    async def scenario() -> None:
        await asyncio.gather(*(consume(engine, f"r{i}", n=2) for i in range(40)))
        await engine.shutdown()

    asyncio.run(scenario())
    assert engine.load_shedder.rejections == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
    assert_idle(engine)


def test_the_offline_path_is_not_shed():
    """LLM registers its whole batch with add_request: nobody could retry a refusal."""
    engine = stand_in_engine(max_num_queued_reqs=1, max_num_queued_tokens=1)

    async def scenario() -> None:
        queues = [engine.add_request(f"r{i}", PROMPT, params(n=2)) for i in range(5)]
        for queue in queues:
            while not (await queue.get()).finished:
                pass
        await engine.shutdown()

    asyncio.run(scenario())
    assert engine.load_shedder.rejections == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
    assert_idle(engine)
