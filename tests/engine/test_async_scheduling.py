"""Asynchronous scheduling on and off give the same outputs on the default model.

Each scenario runs twice on one float32 engine, once with step N+1 planned while step N
runs and once without, and the user-visible results are compared: token ids, text, finish
and stop reasons, logprobs. The scenarios cover greedy and seeded sampling, n > 1,
logprobs, penalties, min_tokens, stop strings, prefix caching, preemption (a second engine
with a small KV pool), abort and a consumer that goes away, and pauses (/pause's three
modes, with and without clearing the cache). After each run the pool is whole again.

Logprobs are compared to 1e-4: the two modes batch the same requests differently (with
overlap, a request that just stopped still has a row in the step planned before its end,
and admissions happen a step later), and a float32 matmul's last bits depend on the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from aioserve import AsyncEngine, SamplingParams
from aioserve.config.engine import engine_config_from_kwargs
from tests.engine.smollm2 import (
    LONG_PASSAGE,
    SHARED_PREFIX,
    collect,
    float32_engine,
    hf_greedy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = float32_engine(smollm2_gguf, max_model_len=1024)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def small_pool_engine(smollm2_gguf):
    """40 blocks of 16 tokens: six requests of ~120 tokens cannot all stay."""
    engine = AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=str(smollm2_gguf),
            dtype="float32",
            seed=0,
            max_model_len=256,
            num_gpu_blocks_override=40,
            block_size=16,
            enforce_eager=True,
        )
    )
    yield engine
    asyncio.run(engine.shutdown())


def summary(outputs) -> list:
    """What a user sees of each request: per sample, ids, text, reasons and logprobs."""
    result = []
    for out in outputs:
        for sample in out.outputs:
            logprobs = None
            if sample.logprobs is not None:
                logprobs = [
                    {token: (lp.logprob, lp.rank) for token, lp in entry.items()}
                    for entry in sample.logprobs
                ]
            result.append(
                (
                    out.request_id,
                    sample.index,
                    list(sample.token_ids),
                    sample.text,
                    sample.finish_reason,
                    sample.stop_reason,
                    logprobs,
                )
            )
    return result


def assert_same(on: list, off: list) -> None:
    assert len(on) == len(off)
    for a, b in zip(on, off, strict=True):
        assert a[:6] == b[:6], f"{a[0]} sample {a[1]}"
        if a[6] is None:
            assert b[6] is None
            continue
        for entry_a, entry_b in zip(a[6], b[6], strict=True):
            assert entry_a.keys() == entry_b.keys()
            for token, (logprob, rank) in entry_a.items():
                assert rank == entry_b[token][1]
                assert math.isclose(logprob, entry_b[token][0], abs_tol=1e-4)


def run_both_ways(engine: AsyncEngine, scenario) -> tuple[list, list]:
    """The scenario's final outputs with asynchronous scheduling on, then off."""
    results = []
    for async_scheduling in (True, False):
        engine.settings = dataclasses.replace(engine.settings, async_scheduling=async_scheduling)
        assert engine.kv_cache.reset_prefix_cache()

        async def run():
            try:
                return await asyncio.wait_for(scenario(engine), 300)
            finally:
                await engine.stop_loop()  # the next run starts a loop with the new setting

        results.append(summary(asyncio.run(run())))
        assert engine.num_unfinished_requests == 0
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return results[0], results[1]


async def final(engine, prompt, params, request_id):
    return (await collect(engine, prompt, params, request_id))[-1]


async def mixed_batch(engine):
    return await asyncio.gather(
        final(
            engine,
            "Write a short poem about the sea.",
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
            "greedy",
        ),
        final(
            engine,
            "Tell me a fact:",
            SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, logprobs=2),
            "seeded-n2",
        ),
        final(
            engine,
            "List the planets of the solar system:",
            SamplingParams(temperature=0.0, max_tokens=60, stop=["Mars", "\n\n"]),
            "stop-string",
        ),
        final(
            engine,
            "The quick brown fox",
            SamplingParams(
                temperature=0.8,
                seed=11,
                max_tokens=30,
                min_tokens=12,
                presence_penalty=0.5,
                frequency_penalty=0.4,
                repetition_penalty=1.3,
            ),
            "penalties",
        ),
        final(
            engine,
            "Count: one, two,",
            SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
            "greedy-logprobs",
        ),
    )


def test_a_mixed_batch_is_the_same_with_and_without_overlap(engine):
    on, off = run_both_ways(engine, mixed_batch)
    assert_same(on, off)
    assert on[0][4] == "length" and len(on[0][2]) == 40


async def shared_prefixes(engine):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    questions = ["Which orbit takes one day?", "What makes sourdough rise?", "How do bees talk?"]
    first = await final(engine, SHARED_PREFIX + questions[0], params, "prefix-0")
    rest = await asyncio.gather(
        *(final(engine, SHARED_PREFIX + q, params, f"prefix-{i}") for i, q in enumerate(questions))
    )
    assert all(out.num_cached_tokens > 0 for out in rest)  # the prefix came from the cache
    return [first, *rest]


def test_prefix_cache_hits_are_the_same_with_and_without_overlap(engine):
    on, off = run_both_ways(engine, shared_prefixes)
    assert_same(on, off)


async def abort_and_disconnect(engine):
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    survivor = asyncio.ensure_future(final(engine, "Describe a forest at dawn.", long, "survivor"))

    async def walk_away():
        got = 0
        async for _ in engine.generate("Write a long story about a lighthouse.", long, "leaver"):
            got += 1
            if got == 4:
                break

    async def aborted():
        outputs = collect(engine, "Another long story:", long, "aborted")
        task = asyncio.ensure_future(outputs)
        while (
            engine.scheduler.get("aborted") is None
            or not engine.scheduler.get("aborted").output_token_ids
        ):
            await asyncio.sleep(0.005)
        engine.abort("aborted")
        outs = await task
        assert outs[-1].outputs[0].finish_reason == "abort"

    await asyncio.gather(walk_away(), aborted())
    return [await survivor]


def test_abort_and_disconnect_leave_the_others_as_they_were(engine):
    on, off = run_both_ways(engine, abort_and_disconnect)
    assert_same(on, off)
    assert len(on[0][2]) == 48


async def crowded(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompts = [f"Story {i}: once upon a time, in a land far away," for i in range(6)]
    before = engine.scheduler.stats.num_preemptions
    outputs = await asyncio.gather(
        *(final(engine, p, params, f"crowd-{i}") for i, p in enumerate(prompts))
    )
    assert engine.scheduler.stats.num_preemptions > before
    return outputs


async def until_generating(engine: AsyncEngine, *sequence_ids: str) -> None:
    def generating(sequence_id: str) -> bool:
        request = engine.scheduler.get(sequence_id)
        return request is not None and request.num_output_tokens > 0

    while not all(map(generating, sequence_ids)):
        await asyncio.sleep(0.005)


PROMPTS = ("The lighthouse keeper wrote that", "Glaciers carve valleys because", "Sourdough")


async def paused_and_resumed(engine):
    """Requests frozen by a "keep" pause (no step in flight once it is complete), then
    made to compute their KV again by a second one that clears the cache; one sent while
    paused; a "wait" pause that lets them finish first; an "abort" pause that ends one."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    frozen = [
        asyncio.ensure_future(final(engine, PROMPTS[0], params, "a")),
        asyncio.ensure_future(final(engine, PROMPTS[1], params, "b")),
    ]
    await until_generating(engine, "a", "b")
    await engine.pause_generation("keep", clear_cache=False)
    assert not any(r.num_pending_tokens for r in engine.scheduler.running)  # none in flight
    made = [engine.scheduler.get(i).num_output_tokens for i in ("a", "b")]
    assert all(0 < n < 16 for n in made) and engine.scheduler.num_running == 2
    held = asyncio.ensure_future(final(engine, PROMPTS[2], params, "held"))
    while engine.scheduler.get("held") is None or not engine.loop_clock.parked:
        await asyncio.sleep(0.005)
    assert not engine._wakeup.is_set()  # the loop has gone round since, and parked
    assert [engine.scheduler.get(i).num_output_tokens for i in ("a", "b")] == made
    await engine.pause_generation("keep")  # clearing the cache preempts them
    assert engine.scheduler.num_running == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.resume_generation()
    await until_generating(engine, "held")
    await engine.pause_generation("wait")  # answered once the three have finished
    assert engine.num_unfinished_requests == 0
    outputs = await asyncio.gather(*frozen, held)
    engine.resume_generation()

    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    ended = asyncio.ensure_future(final(engine, "Tell me a long story.", long, "ended"))
    await until_generating(engine, "ended")
    await engine.pause_generation("abort")
    assert (await ended).outputs[0].finish_reason == "abort"
    engine.resume_generation()
    return outputs


def test_pauses_are_the_same_with_and_without_overlap(engine, smollm2_gguf):
    on, off = run_both_ways(engine, paused_and_resumed)
    assert_same(on, off)
    for entry, prompt in zip(on, PROMPTS, strict=True):  # transformers' tokens, each
        expected = hf_greedy(str(smollm2_gguf), engine.tokenizer(prompt).input_ids, 16)
        assert entry[2] == expected, entry[0]


def test_preemption_is_the_same_with_and_without_overlap(small_pool_engine):
    on, off = run_both_ways(small_pool_engine, crowded)
    assert_same(on, off)
    assert all(len(entry[2]) == 100 for entry in on)


def test_a_failed_step_leaves_none_of_its_blocks_in_the_prefix_cache(engine, monkeypatch):
    """With overlap, a prompt's next chunk is computing while the host records the one
    before; if that step fails, the blocks it was to write must not be offered to the
    next request with the same prompt (they hold whatever an earlier sequence left)."""
    engine.settings = dataclasses.replace(engine.settings, async_scheduling=True)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 32)  # chunks of 32
    prompt = {"prompt_token_ids": engine.tokenizer(LONG_PASSAGE).input_ids[:100]}
    other = {"prompt_token_ids": engine.tokenizer("Different words. " * 40).input_ids[:100]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    execute = engine.runner.execute
    steps = 0

    def second_step_fails(step):
        nonlocal steps
        steps += 1
        if steps == 2:
            raise RuntimeError("injected step failure")
        return execute(step)

    async def scenario():
        try:
            expected = await final(engine, prompt, params, "expected")
            assert engine.kv_cache.reset_prefix_cache()
            await final(engine, other, params, "other")  # the pool's blocks hold its keys now
            assert engine.kv_cache.reset_prefix_cache()
            monkeypatch.setattr(engine.runner, "execute", second_step_fails)
            with pytest.raises(RuntimeError, match="injected step failure"):
                await final(engine, prompt, params, "fails")
            monkeypatch.setattr(engine.runner, "execute", execute)
            again = await final(engine, prompt, params, "again")
            return expected, again
        finally:
            await engine.stop_loop()

    expected, again = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.num_cached_tokens <= 32  # what the step before the failure wrote
    assert engine.num_unfinished_requests == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
