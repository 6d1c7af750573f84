"""Prompt logprobs (SamplingParams(prompt_logprobs=k)) against transformers on the default
model: every prompt token's logprob, rank and top-k match the log-softmax of transformers'
float32 logits over the same prompt, whether the prompt runs in one step or in chunks, and
with prefix caching on (a request that wants prompt logprobs computes its whole prompt:
a cached block has no logits). With DELTA outputs they come once, with the first output.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aioserve import RequestOutputKind, SamplingParams
from tests.engine.smollm2 import (
    LONG_PASSAGE,
    SHARED_PREFIX,
    collect,
    float32_engine,
    hf_prompt_logprobs,
)

pytestmark = pytest.mark.slow

NUM_TOP = 3


@pytest.fixture(scope="module")
def chunked(smollm2_gguf):
    """Chunks of 32 tokens; prefix caching on (the default)."""
    engine = float32_engine(
        smollm2_gguf, 1024, max_num_batched_tokens=32, enable_chunked_prefill=True
    )
    yield engine
    asyncio.run(engine.shutdown())


def prompt_ids(engine, text: str, length: int) -> list[int]:
    return engine.tokenizer(text).input_ids[:length]


def assert_matches_reference(smollm2_gguf, prompt: list[int], prompt_logprobs) -> None:
    expected = hf_prompt_logprobs(str(smollm2_gguf), prompt)
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entries = prompt_logprobs[position]
        row = expected[position - 1]
        token = prompt[position]
        assert token in entries, position
        torch.testing.assert_close(
            entries[token].logprob, row[token].item(), atol=2e-3, rtol=0, msg=f"at {position}"
        )
        assert entries[token].rank == 1 + int((row > row[token]).sum()), position
        top_values, top_ids = row.topk(NUM_TOP)
        ranked = {lp.rank: token_id for token_id, lp in entries.items() if lp.rank <= NUM_TOP}
        for rank in range(1, NUM_TOP + 1):
            gap = (top_values[rank - 1] - top_values[rank]).item() if rank < NUM_TOP else 1.0
            if gap > 1e-3:  # a near tie may order either way
                assert ranked[rank] == top_ids[rank - 1].item(), (position, rank)


def final_output(engine, prompt, params, request_id):
    outputs = asyncio.run(collect(engine, {"prompt_token_ids": prompt}, params, request_id))
    return outputs[-1]


def test_a_prompt_scored_in_chunks_matches_transformers(smollm2_gguf, chunked):
    prompt = prompt_ids(chunked, LONG_PASSAGE, 100)  # four chunks of 32 and one of 4
    params = SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP)
    output = final_output(chunked, prompt, params, "chunked")
    assert_matches_reference(smollm2_gguf, prompt, output.prompt_logprobs)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(smollm2_gguf, chunked):
    first = prompt_ids(chunked, SHARED_PREFIX + "Which orbit takes one day?", 90)
    second = first[:80] + prompt_ids(chunked, "How do bees talk?", 10)
    final_output(chunked, first, SamplingParams(max_tokens=1), "warm-the-cache")
    params = SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP)
    output = final_output(chunked, second, params, "shares-a-prefix")
    assert output.num_cached_tokens == 0
    assert_matches_reference(smollm2_gguf, second, output.prompt_logprobs)
    # Without prompt logprobs the same prompt does use the cache.
    plain = final_output(chunked, second, SamplingParams(max_tokens=1), "plain")
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_delta_outputs_carry_them_once_and_n_siblings_share_them(smollm2_gguf, chunked):
    prompt = prompt_ids(chunked, LONG_PASSAGE, 40)
    params = SamplingParams(
        max_tokens=3, n=2, prompt_logprobs=0, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    outputs = asyncio.run(collect(chunked, {"prompt_token_ids": prompt}, params, "delta"))
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0]
    scored = carrying[0].prompt_logprobs
    assert all(len(entries) == 1 for entries in scored[1:])  # k = 0: the token's own only
    expected = hf_prompt_logprobs(str(smollm2_gguf), prompt)
    for position in range(1, len(prompt)):
        token = prompt[position]
        assert scored[position][token].logprob == pytest.approx(
            expected[position - 1][token].item(), abs=2e-3
        )
    assert chunked.kv_cache.num_free_blocks == chunked.kv_cache.num_blocks


def test_more_prompt_logprobs_than_max_logprobs_are_refused(chunked):
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21"):
        chunked.add_request("too-many", "Hi", SamplingParams(prompt_logprobs=21))
    assert chunked.num_unfinished_requests == 0
