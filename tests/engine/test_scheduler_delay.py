"""--scheduler-delay-factor (vLLM V0's): waiting prompts held back while requests run.

The scheduler runs without a model (sampled tokens are made up) on a clock the test sets
by hand: a schedule is written one step a list, one chunk a string ("A8" is 8 tokens of
A), each step with the clock reading at which it was scheduled.
"""

from __future__ import annotations

import pytest

from aioserve import LLM
from aioserve.cli import main
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.prompt_delay import PromptDelay, prompt_delay
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler import Scheduler, SchedulerOutput
from tests.models.tiny_models import save_tiny_model, tiny_llama_config


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(factor: float, clock: Clock) -> Scheduler:
    return Scheduler(
        KVCacheManager(64, 4, enable_prefix_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=64,
        enable_chunked_prefill=True,
        prompt_delay=prompt_delay(factor, clock),
    )


def _add(scheduler: Scheduler, name: str, arrival: float, max_tokens: int = 2) -> None:
    scheduler.add_request(
        Request(
            request_id=name,
            prompt_token_ids=[1 + i for i in range(8)],
            sampling_params=SamplingParams(max_tokens=max_tokens),
            seed=0,
            eos_token_ids=frozenset(),
            max_tokens=max_tokens,
            arrival_time=arrival,
            arrival_index=len(scheduler._requests),
        )
    )


def _run(
    scheduler: Scheduler,
    clock: Clock,
    times: list[float],
    arrivals: dict[float, list[tuple[str, int]]],
    lag: int = 0,
) -> list[tuple[float, list[str]]]:
    """Schedule a step at each of `times` (requests in `arrivals` added when the clock
    reaches their time), each step's results recorded `lag` steps later; the steps."""
    steps: list[tuple[float, list[str]]] = []
    in_flight: list[SchedulerOutput] = []
    for now in times:
        clock.now = now
        for name, max_tokens in arrivals.get(now, ()):
            _add(scheduler, name, now, max_tokens)
        output = scheduler.schedule()
        steps.append((now, [f"{c.request.request_id}{c.num_tokens}" for c in output.chunks]))
        if output.chunks:
            in_flight.append(output)
        while len(in_flight) > lag:
            done = in_flight.pop(0)
            scheduler.update(done, {c.request.request_id: [7] for c in done.chunks if c.samples})
    return steps


# A decodes from t=0; B arrives at t=2, while A runs; C at t=4.
TIMES = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
ARRIVALS = {0.0: [("A", 8)], 2.0: [("B", 2)], 4.0: [("C", 2)]}


def test_without_the_factor_the_schedule_is_todays():
    clock = Clock()
    scheduler = _scheduler(0.0, clock)
    assert scheduler.prompt_delay is None  # no delay object: the scheduler of before the flag
    assert _run(scheduler, clock, TIMES, ARRIVALS) == [
        (0.0, ["A8"]),
        (1.0, ["A1"]),
        (2.0, ["A1", "B8"]),
        (3.0, ["A1", "B1"]),
        (4.0, ["A1", "C8"]),
        (5.0, ["A1", "C1"]),
        (6.0, ["A1"]),
        (7.0, ["A1"]),
    ]


def test_a_prompt_arriving_while_others_decode_waits_out_the_delay():
    clock = Clock()
    scheduler = _scheduler(1.5, clock)
    steps = _run(scheduler, clock, TIMES, ARRIVALS)
    # A's prompt step took 1.0 (scheduled at 0, the next schedule after its result at 1):
    # B, arriving at 2, waits for more than 1.5 x 1.0 while A decodes, and starts at 4.
    # Its prompt step took 1.0 too; C, arriving at 4, starts once it has waited 1.5 more.
    assert steps == [
        (0.0, ["A8"]),
        (1.0, ["A1"]),
        (2.0, ["A1"]),
        (3.0, ["A1"]),
        (4.0, ["A1", "B8"]),
        (5.0, ["A1", "B1"]),
        (6.0, ["A1", "C8"]),
        (7.0, ["A1", "C1"]),
    ]
    assert scheduler.prompt_delay.last_prompt_latency == 1.0


def test_the_delay_is_the_factor_times_the_last_prompt_steps_latency():
    clock = Clock()
    scheduler = _scheduler(1.0, clock)
    # A's prompt step is scheduled at 0 and the next schedule after its result is at 2.5:
    # 2.5 s of latency. B, arriving at 3, starts once it has waited more than that.
    steps = _run(
        scheduler, clock, [0.0, 2.5, 3.0, 4.0, 5.0, 5.5, 6.0], {0.0: [("A", 8)], 3.0: [("B", 2)]}
    )
    assert [s for _, s in steps] == [["A8"], ["A1"], ["A1"], ["A1"], ["A1"], ["A1"], ["A1", "B8"]]
    assert scheduler.prompt_delay.last_prompt_latency == 2.5


def test_with_results_a_step_late_the_latency_runs_to_the_schedule_after_the_result():
    clock = Clock()
    scheduler = _scheduler(1.0, clock)
    # Asynchronous scheduling: the step after A's prompt step is scheduled at 0.1, before
    # A's result; the latency runs to the first schedule after it, at 1.0, not to 0.1.
    _run(scheduler, clock, [0.0, 0.1, 1.0, 2.0], {0.0: [("A", 8)]}, lag=1)
    assert scheduler.prompt_delay.last_prompt_latency == 1.0


def test_with_nothing_running_a_prompt_starts_at_once():
    clock = Clock()
    scheduler = _scheduler(100.0, clock)
    steps = _run(scheduler, clock, [0.0, 1.0, 2.0, 3.0, 3.5], {0.0: [("A", 2)], 3.5: [("B", 2)]})
    # A ends at 2 (its second token): B arrives to an idle engine and starts without delay,
    # although 100 x the last prompt latency has not passed.
    assert steps == [(0.0, ["A8"]), (1.0, ["A1"]), (2.0, []), (3.0, []), (3.5, ["B8"])]


def test_each_admission_checks_the_oldest_request_still_waiting():
    clock = Clock()
    scheduler = _scheduler(1.0, clock)
    arrivals = {0.0: [("A", 8)], 1.5: [("B", 2)], 2.5: [("C", 2)]}
    steps = _run(scheduler, clock, [0.0, 1.0, 1.5, 2.5, 3.0, 4.0], arrivals)
    # At 2.5 B has waited 1.0, not more than 1.0 x 1.0; at 3.0 it has, and starts; C, then
    # the oldest still waiting, has waited 0.5 only and stays for a later step (vLLM V0's
    # check before each admission), which then takes it: the latency of B's step is 1.0.
    assert [s for _, s in steps] == [
        ["A8"],
        ["A1"],
        ["A1"],
        ["A1"],
        ["A1", "B8"],
        ["A1", "B1", "C8"],
    ]


def test_a_factor_that_is_not_positive_makes_no_delay_object():
    assert prompt_delay(0.0) is None
    with pytest.raises(ValueError, match="greater than 0"):
        PromptDelay(0.0)


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "inf", "soon"])
def test_a_bad_factor_is_refused_at_start_naming_the_flag(value, capsys, tmp_path):
    # Past the check the missing chat template would stop the start, with another message.
    missing = str(tmp_path / "missing.jinja")
    assert main(["serve", "--scheduler-delay-factor", value, "--chat-template", missing]) == 2
    error = capsys.readouterr().err
    assert error.startswith("aioserve: error: --scheduler-delay-factor must be a number at least 0")
    assert repr(value) in error
    with pytest.raises(ConfigError, match="^scheduler_delay_factor must be a number at least 0"):
        engine_config_from_kwargs(scheduler_delay_factor=value)


def test_the_engine_schedules_with_the_flags_factor(tmp_path):
    folder = save_tiny_model(tiny_llama_config(), tmp_path)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        enforce_eager=True,
        skip_tokenizer_init=True,
        scheduler_delay_factor=0.25,
    )
    try:
        delay = llm.engine.scheduler.prompt_delay
        assert (llm.engine.settings.scheduler_delay_factor, delay.factor) == (0.25, 0.25)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7]}],
            params,
            use_tqdm=False,
        )
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
        assert delay.last_prompt_latency > 0  # measured on the engine's prompt step
    finally:
        llm.close()
    default = engine_config_from_kwargs()
    assert default.scheduler.scheduler_delay_factor == 0.0
