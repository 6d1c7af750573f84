"""The stand-in runner's queued steps: `execute` returns at once, as a GPU runner's does, and
the steps occupy the "device" one after another, each ready when its time is out."""

from __future__ import annotations

import asyncio
import time

from aioserve.engine.sampling_params import SamplingParams
from aioserve.runner.stand_in_runner import StandInRunner, stand_in_token
from aioserve.runner.step_plan import NewSequence, SamplingSettings, SequenceChunk, StepPlan
from tests.engine.test_async_scheduling_properties import VOCAB, engine_on

STEP = 0.05


def prefill_plan() -> StepPlan:
    settings = SamplingSettings(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=7)
    return StepPlan(
        new_sequences=[NewSequence("a", [1, 2, 3], [], settings)],
        chunks=[SequenceChunk("a", 0, 3, [1, 2, 3], [0], True)],
        finished_seq_ids=[],
    )


def decode_plan() -> StepPlan:
    return StepPlan(
        new_sequences=[], chunks=[SequenceChunk("a", 3, 1, None, [], True)], finished_seq_ids=[]
    )


def test_queued_steps_return_at_once_and_are_ready_one_step_after_another():
    runner = StandInRunner(VOCAB, step_seconds=STEP, queued=True)
    queued_at = time.perf_counter()
    first = runner.execute(runner.prepare(prefill_plan()))
    second = runner.execute(runner.prepare(decode_plan()))
    assert time.perf_counter() - queued_at < STEP / 2  # neither waited for the device
    assert not first.is_ready() and not second.is_ready()
    first.wait()
    assert time.perf_counter() - queued_at >= STEP
    assert not second.is_ready()  # it started when the first ended
    second.wait()
    assert time.perf_counter() - queued_at >= 2 * STEP
    assert runner.device_idle_seconds == 0.0
    assert second.sampled == {"a": [stand_in_token(7, 1, VOCAB)]}


def test_a_device_with_nothing_queued_counts_its_idle_time():
    runner = StandInRunner(VOCAB, step_seconds=STEP, queued=True)
    runner.execute(runner.prepare(prefill_plan())).wait()
    time.sleep(STEP)
    runner.execute(runner.prepare(decode_plan())).wait()
    assert STEP <= runner.device_idle_seconds < 3 * STEP


def test_the_engine_gives_the_same_tokens_on_queued_and_waited_steps():
    async def tokens(queued: bool) -> list[list[int]]:
        runner = StandInRunner(VOCAB, step_seconds=0.002, queued=queued)
        engine = engine_on(runner, async_scheduling=True)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        try:
            outputs = await asyncio.gather(
                *(collect(engine, [3 + i, 4, 5], params, f"r{i}") for i in range(3))
            )
        finally:
            await engine.shutdown()
        return outputs

    waited, queued = asyncio.run(tokens(False)), asyncio.run(tokens(True))
    assert queued == waited
    assert all(len(sample) == 12 for sample in queued)


async def collect(engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    final = None
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        final = output
    return final.outputs[0].token_ids
