"""vLLM 0.32's scheduler limits in the scheduler (no model: sampled tokens are made up):
--max-num-scheduled-tokens, --max-num-active-seqs, --watermark, --scheduler-reserve-full-isl
and --long-prefill-token-threshold-adaptive; their checks at start-up.

Schedules are compared step by step with a reference of vLLM's rule
(scheduler_032_reference.py), on hand-made workloads whose schedule is also written out, and
on random ones. A schedule is one list a step: "A8" is 8 tokens of A, "-B" B preempted.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import SchedulerConfig, engine_config_from_kwargs
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler import Scheduler
from aioserve.engine.scheduler_limits import (
    SchedulerLimits,
    long_prefill_cap,
    resolve_scheduler_limits,
)
from tests.engine.scheduler_032_reference import BLOCK_SIZE, Job, Limits, reference_trace
from tests.engine.test_kv_cache_manager import BlockPoolMachine


def _scheduler(limits: Limits) -> Scheduler:
    return Scheduler(
        KVCacheManager(limits.num_blocks, BLOCK_SIZE, enable_prefix_caching=False),
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=limits.max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=limits.threshold,
        limits=SchedulerLimits(
            max_num_scheduled_tokens=limits.max_num_scheduled_tokens,
            max_num_active_seqs=limits.max_num_active_seqs,
            watermark=limits.watermark,
            reserve_full_isl=limits.reserve_full_isl,
            adaptive_long_prefill_threshold=limits.adaptive,
        ),
    )


def aioserve_trace(jobs: list[Job], limits: Limits, max_steps: int = 400) -> list[list[str]]:
    """The steps aioserve's scheduler gives `jobs`, each step's result recorded before the
    next (a sampled token is 7: no EOS); the pool is whole at the end."""
    scheduler = _scheduler(limits)
    trace: list[list[str]] = []
    max_running = 0
    for step in range(max_steps):
        for i, job in enumerate(jobs):
            if job.arrival == step:
                scheduler.add_request(
                    Request(
                        request_id=job.name,
                        prompt_token_ids=[1 + t % 30 for t in range(job.prompt)],
                        sampling_params=SamplingParams(max_tokens=job.max_tokens),
                        seed=0,
                        eos_token_ids=frozenset(),
                        max_tokens=job.max_tokens,
                        arrival_index=i,
                    )
                )
        if not scheduler.has_unfinished() and step > max(job.arrival for job in jobs):
            assert scheduler.kv_cache.num_free_blocks == limits.num_blocks, "blocks leaked"
            return trace
        output = scheduler.schedule()
        max_running = max(max_running, scheduler.num_running)
        assert max_running <= (limits.max_num_active_seqs or limits.max_num_seqs)
        trace.append(
            [f"{c.request.request_id}{c.num_tokens}" for c in output.chunks]
            + [f"-{r.request_id}" for r in output.preempted]
        )
        scheduler.update(output, {c.request.request_id: [7] for c in output.chunks if c.samples})
    raise AssertionError(f"not finished in {max_steps} steps: {trace[-5:]}")


def _both(jobs: list[Job], limits: Limits) -> list[list[str]]:
    expected = reference_trace(jobs, limits)
    assert aioserve_trace(jobs, limits) == expected
    return expected


# -- hand-made workloads ----------------------------------------------------------------------


def test_max_num_scheduled_tokens_is_the_steps_budget():
    jobs = [Job("A", 0, 20, 2), Job("B", 0, 6, 2)]
    roomy = Limits(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
    assert _both(jobs, roomy) == [["A16"], ["A4", "B6"], ["A1", "B1"]]
    limited = Limits(
        num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, max_num_scheduled_tokens=8
    )
    assert _both(jobs, limited) == [["A8"], ["A8"], ["A4", "B4"], ["A1", "B2"], ["B1"]]
    # Above --max-num-batched-tokens the smaller budget binds, as in vLLM.
    above = Limits(
        num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, max_num_scheduled_tokens=99
    )
    assert _both(jobs, above) == _both(jobs, roomy)


def test_max_num_active_seqs_caps_the_running_requests():
    jobs = [Job(name, 0, 3, 3) for name in "ABCD"]
    capped = Limits(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, max_num_active_seqs=2)
    assert _both(jobs, capped) == [
        ["A3", "B3"],
        ["A1", "B1"],
        ["A1", "B1"],  # A and B finish: C and D start
        ["C3", "D3"],
        ["C1", "D1"],
        ["C1", "D1"],
    ]
    uncapped = Limits(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    assert _both(jobs, uncapped)[0] == ["A3", "B3", "C3", "D3"]


def test_watermark_keeps_blocks_free_while_others_run():
    # 16 blocks; A takes 2 (8 tokens), B's 24-token prompt 6 more: 8 left, or 7 once A grows.
    jobs = [Job("A", 0, 8, 6), Job("B", 1, 24, 2)]
    plain = Limits(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8)
    assert _both(jobs, plain)[1] == ["A1", "B24"]
    # int(0.5 * 16) = 8 blocks must stay free: B waits until A has finished.
    marked = Limits(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8, watermark=0.5)
    assert _both(jobs, marked) == [["A8"]] + [["A1"]] * 5 + [["B24"], ["B1"]]
    # Alone, a request starts whatever the watermark: nobody runs to need the headroom.
    assert _both([Job("B", 0, 60, 1)], marked) == [["B60"]]


def test_reserve_full_isl_admits_only_a_prompt_that_fits_whole():
    # 16 blocks (64 tokens); A (24 tokens, 6 blocks) decodes while B's 44-token prompt
    # (11 blocks) comes in chunks of the 12-token budget.
    jobs = [Job("A", 0, 24, 12), Job("B", 1, 44, 2)]
    whole = Limits(num_blocks=16, max_num_batched_tokens=12, max_num_seqs=8)
    first_chunk = Limits(
        num_blocks=16, max_num_batched_tokens=12, max_num_seqs=8, reserve_full_isl=False
    )
    # Whole prompts: B waits for A's blocks, and nobody is preempted.
    with_whole = _both(jobs, whole)
    assert not any(chunk.startswith("-") for step in with_whole for chunk in step)
    assert with_whole[:3] == [["A12"], ["A12"], ["A1"]]
    assert ["B12"] in with_whole
    # First chunks only (aioserve's rule before vLLM 0.32's flag): B starts beside A, the
    # pool runs out as both grow, and B, the later arrival, is preempted.
    with_chunk = _both(jobs, first_chunk)
    assert with_chunk[2] == ["A1", "B11"]
    assert ["A1", "-B"] in with_chunk


@pytest.mark.parametrize(("adaptive", "first_step"), [(False, ["A2", "B2"]), (True, ["A8", "B8"])])
def test_adaptive_threshold_floors_the_cap_at_a_fair_share(adaptive, first_step):
    jobs = [Job("A", 0, 20, 1), Job("B", 0, 20, 1)]
    limits = Limits(
        num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, threshold=2, adaptive=adaptive
    )
    assert _both(jobs, limits)[0] == first_step


def test_long_prefill_cap():
    assert long_prefill_cap(0, 5, 100, adaptive=True) == 0  # no threshold: nothing to floor
    assert long_prefill_cap(4, 1, 100, adaptive=True) == 0  # alone: no cap
    assert long_prefill_cap(4, 5, 100, adaptive=False) == 4
    assert long_prefill_cap(4, 5, 100, adaptive=True) == 20
    assert long_prefill_cap(40, 5, 100, adaptive=True) == 40


def test_fits_counts_the_cached_blocks_it_takes_from_the_free_queue():
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)

    def request(name: str, prompt: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        return Request(name, prompt, params, seed=0, eos_token_ids=frozenset(), max_tokens=1)

    first = request("first", list(range(1, 10)))
    assert kv.allocate(first, 9)
    kv.cache_full_blocks(first, 9)
    kv.free(first)  # its two full blocks stay cached, in the free queue
    other = request("other", list(range(50, 66)))
    assert kv.allocate(other, 16)  # 4 blocks: 4 left, the cached two among them
    again = request("again", list(range(1, 9)) + list(range(70, 78)))
    cached = kv.find_cached_prefix(again)
    assert len(cached) == 2
    # 16 tokens: 2 new blocks, and the 2 cached ones leave the free queue too.
    assert kv.fits(16, cached)
    assert not kv.fits(16, cached, keep_free=1)
    assert not kv.fits(17, cached)
    # Shared with a running request, a cached block is no longer free: it costs nothing.
    sharer = request("sharer", list(range(1, 9)) + [99])
    assert kv.allocate(sharer, 9 - 8, kv.find_cached_prefix(sharer))
    assert kv.num_free_blocks == 1
    assert kv.fits(12, cached)
    assert not kv.fits(13, cached)


# -- random workloads -------------------------------------------------------------------------

_JOBS = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=6
)


@st.composite
def _limits(draw) -> Limits:
    max_num_seqs = draw(st.integers(1, 6))
    return Limits(
        num_blocks=draw(st.integers(16, 30)),
        max_num_batched_tokens=draw(st.integers(4, 24)),
        max_num_seqs=max_num_seqs,
        max_num_scheduled_tokens=draw(st.none() | st.integers(1, 24)),
        max_num_active_seqs=draw(st.none() | st.integers(1, max_num_seqs)),
        watermark=draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9])),
        reserve_full_isl=draw(st.booleans()),
        threshold=draw(st.sampled_from([0, 3, 8])),
        adaptive=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=_JOBS, limits=_limits())
def test_random_workloads_follow_vllms_rule(raw, limits):
    jobs = [Job("ABCDEF"[i], arrival, prompt, out) for i, (arrival, prompt, out) in enumerate(raw)]
    assert aioserve_trace(jobs, limits) == reference_trace(jobs, limits)


class LimitsBlockPoolMachine(BlockPoolMachine):
    """The random block-pool machine of test_kv_cache_manager.py (prefix caching, aborts,
    preemption) with the limits set: no block leaks, nothing hangs, the caps hold."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=6,
            max_num_batched_tokens=16,
            max_model_len=64,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=5,
        )

    @initialize(
        scheduled=st.none() | st.integers(1, 20),
        active=st.none() | st.integers(1, 6),
        watermark=st.sampled_from([0.0, 0.2, 0.5]),
        whole=st.booleans(),
        adaptive=st.booleans(),
    )
    def set_limits(self, scheduled, active, watermark, whole, adaptive):
        self.scheduler.limits = SchedulerLimits(scheduled, active, watermark, whole, adaptive)

    @invariant()
    def caps_hold(self):
        assert self.scheduler.num_running <= self.scheduler.max_num_active_seqs


LimitsBlockPoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLimitsBlockPool = LimitsBlockPoolMachine.TestCase


# -- start-up checks --------------------------------------------------------------------------


def test_defaults_are_vllms():
    scheduler = engine_config_from_kwargs().scheduler
    assert scheduler.max_num_scheduled_tokens is None
    assert scheduler.max_num_active_seqs is None
    assert scheduler.watermark == 0.0
    assert scheduler.scheduler_reserve_full_isl is True
    assert scheduler.long_prefill_token_threshold_adaptive is False
    assert SchedulerLimits() == SchedulerLimits(None, None, 0.0, True, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"watermark": 1.0}, "watermark must be at least 0 and less than 1"),
        ({"watermark": -0.1}, "watermark must be a number at least 0"),
        ({"watermark": "lots"}, "watermark must be a number at least 0"),
        ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens must be at least 1"),
        ({"max_num_scheduled_tokens": "2x"}, "max_num_scheduled_tokens must be an integer"),
        ({"max_num_active_seqs": 0}, "max_num_active_seqs must be at least 1"),
        ({"scheduler_reserve_full_isl": "yes"}, "scheduler_reserve_full_isl must be true or false"),
        (
            {"max_num_active_seqs": 5, "max_num_seqs": 4},
            r"--max-num-active-seqs \(5\) cannot be greater than --max-num-seqs \(4\)",
        ),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        engine_config_from_kwargs(**kwargs)


def test_human_readable_scheduled_tokens():
    assert (
        engine_config_from_kwargs(max_num_scheduled_tokens="2k").scheduler.max_num_scheduled_tokens
        == 2000
    )
    assert (
        engine_config_from_kwargs(max_num_scheduled_tokens="2K").scheduler.max_num_scheduled_tokens
        == 2048
    )


def _resolve(chunked: bool = True, max_num_seqs: int = 8, **kwargs) -> SchedulerLimits:
    scheduler: SchedulerConfig = engine_config_from_kwargs(**kwargs).scheduler
    return resolve_scheduler_limits(scheduler, 64, max_num_seqs, 256, chunked)


def test_resolution_checks_the_engines_values():
    assert _resolve() == SchedulerLimits()
    assert _resolve(max_num_active_seqs=3, watermark=0.25) == SchedulerLimits(
        max_num_active_seqs=3, watermark=0.25
    )
    # The platform's max_num_seqs is known only here.
    with pytest.raises(ValueError, match=r"--max-num-active-seqs \(9\) cannot be greater"):
        _resolve(max_num_active_seqs=9)
    # Without chunked prefill a prompt runs whole: a smaller budget would never run it.
    with pytest.raises(ValueError, match=r"--max-num-scheduled-tokens \(100\) is smaller than"):
        _resolve(chunked=False, max_num_scheduled_tokens=100)
    assert _resolve(chunked=False, max_num_scheduled_tokens=256).max_num_scheduled_tokens == 256


def test_adaptive_without_a_threshold_warns(caplog):
    with caplog.at_level("WARNING", logger="aioserve"):
        _resolve(long_prefill_token_threshold_adaptive=True)
    assert "has no effect without a nonzero --long-prefill-token-threshold" in caplog.text
