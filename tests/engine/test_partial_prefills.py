"""--max-num-partial-prefills and --max-long-partial-prefills in the scheduler (no model:
sampled tokens are made up), and in an engine on a tiny random Llama.

A schedule is written one step a list, one chunk a string: "A8" is 8 tokens of A.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from aioserve import LLM, SamplingParams
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.partial_prefills import (
    PartialPrefillLimits,
    in_prefill,
    partial_prefill_limits,
)
from aioserve.engine.request import Request, RequestStatus
from aioserve.engine.sampling_params import SamplingParams as EngineSamplingParams
from aioserve.engine.scheduler import Scheduler
from aioserve.engine.settings import EngineSettings
from tests.engine.test_kv_cache_manager import NUM_BLOCKS, BlockPoolMachine
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
THRESHOLD = 8  # prompts longer than this are long


def _scheduler(
    partial_prefills: PartialPrefillLimits | None,
    *,
    num_blocks: int = 64,
    policy: str = "fcfs",
    budget: int = 16,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        policy=policy,
        partial_prefills=partial_prefills,
    )


def _limits(max_num: int, max_long: int) -> PartialPrefillLimits:
    return PartialPrefillLimits(max_num, max_long, THRESHOLD)


def _add(scheduler: Scheduler, name: str, num_tokens: int, priority: int = 0) -> Request:
    request = Request(
        request_id=name,
        prompt_token_ids=[1 + i % 30 for i in range(num_tokens)],
        sampling_params=EngineSamplingParams(max_tokens=2),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=2,
        priority=priority,
        arrival_index=len(scheduler._requests),
    )
    scheduler.add_request(request)
    return request


def _run(scheduler: Scheduler, *, lag: int = 0, max_steps: int = 100) -> list[list[str]]:
    """Schedule until every request has ended; each step's results arrive `lag` steps late
    (asynchronous scheduling). After every step at most N sequences are mid-prefill."""
    schedule, in_flight = [], []
    limit = scheduler.partial_prefills.max_num_partial_prefills if scheduler.partial_prefills else 1
    while scheduler.has_unfinished() or in_flight:
        assert len(schedule) < max_steps, schedule
        output = scheduler.schedule()
        if output.chunks:
            schedule.append([f"{c.request.request_id}{c.num_tokens}" for c in output.chunks])
            in_flight.append(output)
        if scheduler.partial_prefills is not None:
            assert sum(map(in_prefill, scheduler.running)) <= limit
        if len(in_flight) > lag or (output.is_empty and in_flight):
            done = in_flight.pop(0)
            scheduler.update(done, {c.request.request_id: [7] for c in done.chunks if c.samples})
    return schedule


def _first_token_step(schedule: list[list[str]], name: str, num_prompt_tokens: int) -> int:
    """The step (from 1) whose chunk of `name` reaches the end of its prompt."""
    done = 0
    for step, chunks in enumerate(schedule, 1):
        for chunk in chunks:
            if chunk[0] == name:
                done += int(chunk[1:])
                if done >= num_prompt_tokens:
                    return step
    raise AssertionError(f"{name} never finished its prompt")


@pytest.mark.parametrize("lag", [0, 1])
def test_by_default_one_prompt_takes_the_budget_as_before(lag):
    """max_num_partial_prefills 1: no limits, and the schedule of the scheduler without them."""
    scheduler = _scheduler(partial_prefill_limits(1, 1, 0, MAX_MODEL_LEN))
    for name, length in [("A", 40), ("B", 30), ("C", 5)]:
        _add(scheduler, name, length)
    assert _run(scheduler, lag=lag) == [
        ["A16"],
        ["A16"],
        ["A8", "B8"],
        ["A1", "B15"],
        ["B7", "C5"],
        ["B1", "C1"],
    ]


def test_two_long_prompts_share_the_budget():
    scheduler = _scheduler(_limits(2, 2))
    for name in "AB":
        _add(scheduler, name, 40)
    assert _run(scheduler) == [
        ["A8", "B8"],
        ["A8", "B8"],
        ["A8", "B8"],
        ["A8", "B8"],
        ["A8", "B8"],
        ["A1", "B1"],
    ]


def test_a_third_prompt_waits_while_two_are_mid_prefill():
    scheduler = _scheduler(_limits(2, 2), budget=17)
    for name, length in [("A", 30), ("B", 30), ("C", 5)]:
        _add(scheduler, name, length)
    # 17 // 2 = 8 tokens each; the token left would leave C a third prompt mid-prefill.
    assert _run(scheduler)[:5] == [
        ["A8", "B8"],
        ["A8", "B8"],
        ["A8", "B8"],
        ["A6", "B6", "C5"],
        ["A1", "B1", "C1"],
    ]


def test_a_short_prompt_goes_ahead_of_a_long_one_past_the_long_limit():
    """With one long prefill at a time, the short prompt behind two long ones starts in the
    first step, instead of after the first long prompt's whole prefill."""
    prompts = [("A", 40), ("B", 30), ("C", 5)]
    schedules = {}
    for limits in (None, _limits(2, 1)):
        scheduler = _scheduler(limits)
        for name, length in prompts:
            _add(scheduler, name, length)
        schedules[limits] = _run(scheduler)
    assert schedules[_limits(2, 1)][0] == ["A8", "C5"]  # B, long, passed over
    assert _first_token_step(schedules[None], "C", 5) == 5
    assert _first_token_step(schedules[_limits(2, 1)], "C", 5) == 1
    # B starts once A has no more than THRESHOLD tokens left, not before.
    assert schedules[_limits(2, 1)] == [
        ["A8", "C5"],
        ["A16"],  # alone in its prefill: the whole budget (C's decode waits behind it)
        ["A16"],
        ["A1", "C1", "B14"],
        ["B16"],
        ["B1"],
    ]


def test_a_passed_over_long_prompt_keeps_its_place_in_the_queue():
    scheduler = _scheduler(_limits(2, 1))
    for name, length in [("A", 24), ("B", 20), ("C", 3), ("D", 20), ("E", 3)]:
        _add(scheduler, name, length)
    schedule = _run(scheduler)
    assert schedule[0] == ["A8", "C3", "E3"]  # B and D passed over, C and E go ahead
    starts = [chunk[0] for chunks in schedule for chunk in chunks]
    assert starts.index("B") < starts.index("D")  # B first, as it came first
    assert _first_token_step(schedule, "B", 20) < _first_token_step(schedule, "D", 20)


def test_the_priority_policy_ranks_the_long_prompts_and_the_short_ones():
    scheduler = _scheduler(_limits(2, 1), policy="priority")
    _add(scheduler, "L", 24, priority=1)
    _add(scheduler, "U", 24, priority=-1)  # urgent: the long prefill that starts
    _add(scheduler, "S", 4, priority=5)  # short: goes ahead of L
    schedule = _run(scheduler)
    assert schedule[0] == ["U8", "S4"]
    assert _first_token_step(schedule, "U", 24) < _first_token_step(schedule, "L", 24)


def test_a_lone_long_prompt_is_not_held_back():
    scheduler = _scheduler(_limits(2, 1))
    _add(scheduler, "A", 40)
    assert _run(scheduler) == [["A16"], ["A16"], ["A8"], ["A1"]]


@pytest.mark.parametrize("lag", [0, 1])
def test_preemption_in_a_small_pool_leaks_no_block(lag):
    num_blocks = 14  # 56 tokens for prompts of 100
    scheduler = _scheduler(_limits(3, 2), num_blocks=num_blocks)
    requests = [
        _add(scheduler, name, n) for name, n in zip("ABCDEF", [30, 5, 22, 40, 3, 18], strict=True)
    ]
    schedule = _run(scheduler, lag=lag, max_steps=200)
    assert scheduler.stats.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert [len(r.output_token_ids) for r in requests] == [2] * 6
    assert scheduler.kv_cache.num_free_blocks == num_blocks and not scheduler.kv_cache.owners()
    assert max(len(chunks) for chunks in schedule) > 1


class PartialPrefillBlockPoolMachine(BlockPoolMachine):
    """The random block-pool machine of test_kv_cache_manager.py, with partial prefills."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler.partial_prefills = PartialPrefillLimits(2, 1, 6)

    @invariant()
    def at_most_two_are_mid_prefill(self):
        assert sum(map(in_prefill, self.scheduler.running)) <= 2
        assert self.kv.num_free_blocks <= NUM_BLOCKS


PartialPrefillBlockPoolMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPartialPrefillBlockPool = PartialPrefillBlockPoolMachine.TestCase


# -- an engine --------------------------------------------------------------------------------

PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(70)],
    [5, 17, 99, 3],
    [(11 * i + 5) % 250 + 1 for i in range(45)],
    [8, 1, 200, 31, 64],
    [(13 * i + 1) % 250 + 1 for i in range(60)],
    [2, 90],
]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


def _greedy(folder, **options) -> tuple[list[list[int]], list[list[int]], EngineSettings]:
    """Greedy tokens of PROMPTS, the engine's schedule (each step's chunk sizes) and its
    settings."""
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enforce_eager=True,
        skip_tokenizer_init=True,
        **options,
    )
    try:
        scheduler = llm.engine.scheduler
        schedule, plain = [], scheduler.schedule

        def recorded():
            output = plain()
            schedule.append([c.num_tokens for c in output.chunks])
            return output

        scheduler.schedule = recorded
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [out.outputs[0].token_ids for out in outputs], schedule, llm.engine.settings
    finally:
        llm.close()


@pytest.fixture(scope="module")
def default_engine_run(tiny_folder):
    return _greedy(tiny_folder)


@pytest.mark.parametrize(("threshold", "long_prompt_threshold"), [(20, 20), (None, 10)])
def test_an_engine_with_partial_prefills_gives_the_default_engines_tokens(
    tiny_folder, default_engine_run, threshold, long_prompt_threshold
):
    """Without --long-prefill-token-threshold, prompts past 4% of the context are long."""
    expected, default_schedule, _ = default_engine_run
    tokens, schedule, engine_settings = _greedy(
        tiny_folder,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=threshold,
    )
    assert engine_settings.partial_prefills == PartialPrefillLimits(2, 1, long_prompt_threshold)
    assert tokens == expected
    # The short prompts start beside the first long prompt, which takes its half of the
    # budget; the other long ones wait. The default engine gives the first prompt it all.
    assert schedule[0] == [16, 4, 5, 2]
    assert default_schedule[0] == [32]
