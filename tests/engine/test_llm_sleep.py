"""Offline sleep mode: LLM(enable_sleep_mode=True).sleep(level) frees the KV pool's memory
(and at level 2 the weights), wake_up brings it back, and greedy tokens are the same
before and after; a partial wake says it is not fully awake; no KV block is left held."""

from __future__ import annotations

import pytest

from aioserve.engine.llm import LLM
from aioserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 504, 1987, 3416, 314, 260]}


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    with LLM(
        str(smollm2_gguf), dtype="float32", enforce_eager=True, max_model_len=256,
        enable_sleep_mode=True, seed=0,
    ) as llm:  # fmt: skip
        yield llm


def _tokens(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_tokens(llm, level):
    before = _tokens(llm)
    pool = llm.engine.runner.kv_caches[0][0].untyped_storage()
    llm.sleep(level=level)
    assert pool.nbytes() == 0 and llm.engine.is_sleeping
    assert llm.wake_up(tags=["kv_cache"]) is False
    assert llm.wake_up() is True
    assert pool.nbytes() > 0 and not llm.engine.is_sleeping
    assert _tokens(llm) == before
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_release_kv_cache_memory_after_a_level_0_sleep(llm):
    before = _tokens(llm)
    llm.sleep(level=0)
    llm.release_kv_cache_memory()
    assert llm.engine.runner.kv_caches[0][0].untyped_storage().nbytes() == 0
    assert llm.wake_up(tags=["kv_cache", "scheduling"]) is True
    assert _tokens(llm) == before
