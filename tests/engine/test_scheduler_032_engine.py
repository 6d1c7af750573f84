"""vLLM 0.32's scheduler limits in an engine on a tiny random Llama: each changes the
schedule as its rule says (tokens a step, requests running, preemptions) and leaves the
greedy tokens those of an engine without it. The rules themselves are tested step by step
in test_scheduler_032.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from aioserve import LLM, SamplingParams
from aioserve.engine.scheduler_limits import SchedulerLimits
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(70)],
    [5, 17, 99, 3],
    [(11 * i + 5) % 250 + 1 for i in range(45)],
    [8, 1, 200, 31, 64],
    [(13 * i + 1) % 250 + 1 for i in range(60)],
    [2, 90],
]
NEW_TOKENS = 8


@dataclass
class Run:
    tokens: list[list[int]]
    step_tokens: list[int]  # tokens each step computed
    max_running: int  # most requests running after a step was scheduled
    num_preemptions: int
    limits: SchedulerLimits
    runner_max_num_seqs: int


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


def _run(folder, **options) -> Run:
    settings = dict(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
    )
    llm = LLM(**{**settings, **options})
    try:
        scheduler = llm.engine.scheduler
        step_tokens, running, plain = [], [0], scheduler.schedule

        def recorded():
            output = plain()
            step_tokens.append(output.num_tokens)
            running[0] = max(running[0], scheduler.num_running)
            return output

        scheduler.schedule = recorded
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.settings.num_blocks
        return Run(
            [out.outputs[0].token_ids for out in outputs],
            [n for n in step_tokens if n],
            running[0],
            scheduler.stats.num_preemptions,
            llm.engine.settings.scheduler_limits,
            llm.engine.runner.max_num_seqs,
        )
    finally:
        llm.close()


@pytest.fixture(scope="module")
def default_run(tiny_folder) -> Run:
    return _run(tiny_folder)


SMALL_POOL = dict(max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=32)
"""12 blocks of 16 tokens for the prompts and their answers, which need 17 in all."""


@pytest.fixture(scope="module")
def small_pool_run(tiny_folder) -> Run:
    """Whole prompts reserved (vLLM's default): nobody is preempted."""
    return _run(tiny_folder, **SMALL_POOL)


def test_max_num_scheduled_tokens(tiny_folder, default_run):
    run = _run(tiny_folder, max_num_scheduled_tokens="16")
    assert run.limits.max_num_scheduled_tokens == 16
    assert run.tokens == default_run.tokens
    assert max(run.step_tokens) == 16
    assert max(default_run.step_tokens) == 64


def test_max_num_active_seqs(tiny_folder, default_run):
    run = _run(tiny_folder, max_num_active_seqs=2)
    assert run.tokens == default_run.tokens
    assert run.max_running == 2
    assert default_run.max_running == len(PROMPTS)
    assert run.runner_max_num_seqs == default_run.runner_max_num_seqs == 8


def test_long_prefill_token_threshold_adaptive(tiny_folder, default_run):
    capped = _run(tiny_folder, long_prefill_token_threshold=4)
    adaptive = _run(
        tiny_folder, long_prefill_token_threshold=4, long_prefill_token_threshold_adaptive=True
    )
    assert capped.tokens == adaptive.tokens == default_run.tokens
    # Six requests: each computes at most 4 tokens, or with the floor 64 // 6 = 10.
    assert capped.step_tokens[0] == 4 + 4 + 4 + 4 + 4 + 2
    assert adaptive.step_tokens[0] == 10 + 4 + 10 + 5 + 10 + 2


def test_reserve_full_isl(tiny_folder, default_run, small_pool_run):
    first_chunks = _run(tiny_folder, **SMALL_POOL, scheduler_reserve_full_isl=False)
    assert first_chunks.limits.reserve_full_isl is False
    assert small_pool_run.limits.reserve_full_isl is True
    assert first_chunks.tokens == small_pool_run.tokens == default_run.tokens
    assert small_pool_run.num_preemptions == 0
    # Admitted on their first chunks, more requests run at once, and outgrow the pool.
    assert first_chunks.num_preemptions > 0
    assert first_chunks.max_running > small_pool_run.max_running


def test_watermark(tiny_folder, small_pool_run):
    run = _run(tiny_folder, **SMALL_POOL, watermark=0.3)
    assert run.limits.watermark == 0.3
    assert run.tokens == small_pool_run.tokens
    # int(0.3 * 12) = 3 blocks stay free at each admission while others run.
    assert run.max_running < small_pool_run.max_running


def test_a_pooling_engine_takes_the_limits_too(minilm_folder):
    """A pooling model's scheduler runs each prompt whole: --max-num-active-seqs caps the
    prompts of a step, and a --max-num-scheduled-tokens below the context is refused."""
    texts = [f"sentence number {i} about scheduling" for i in range(5)]

    def embed(**options) -> tuple[list[list[float]], int]:
        with LLM(str(minilm_folder), dtype="float32", max_num_seqs=4, **options) as llm:
            scheduler, most, plain = llm.engine.scheduler, [0], llm.engine.scheduler.schedule

            def recorded():
                output = plain()
                most[0] = max(most[0], len(output.chunks))
                return output

            scheduler.schedule = recorded
            outputs = llm.embed(texts, use_tqdm=False)
            return [out.outputs.embedding for out in outputs], most[0]

    vectors, most = embed()
    capped, most_capped = embed(max_num_active_seqs=1)
    assert (most, most_capped) == (4, 1)
    for got, expected in zip(capped, vectors, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=r"--max-num-scheduled-tokens \(16\) is smaller than"):
        LLM(str(minilm_folder), dtype="float32", max_num_scheduled_tokens=16)
