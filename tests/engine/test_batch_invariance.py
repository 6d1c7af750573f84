"""VLLM_BATCH_INVARIANT=1: a seeded request gets the same tokens and the same logprobs, bit
for bit, alone and among 63 other requests (SmolLM2's real weights), on the CPU and, under
`pytest -m gpu`, on a GPU (its GGUF layers through the quantized kernels' widest tile, its
head through the fixed-tile dense GEMM).

Prefix caching is off, so the second run computes the prompt again rather than reading the
first run's blocks; every prompt fits in one prefill step, so no prompt is cut into chunks
differently in the two runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.kernels import dispatch


@pytest.fixture
def batch_invariant_llm(smollm2_gguf):
    dispatch.set_batch_invariant(True)
    try:
        llm = LLM(
            model=str(smollm2_gguf),
            max_model_len=256,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
            seed=0,
        )
        yield llm
        llm.close()
    finally:
        dispatch.set_batch_invariant(False)


def _samples(output) -> tuple[list[int], list[dict[int, float]]]:
    sample = output.outputs[0]
    logprobs = [{token: lp.logprob for token, lp in step.items()} for step in sample.logprobs]
    return list(sample.token_ids), logprobs


def test_a_seeded_request_gets_the_same_bits_alone_and_in_a_batch_of_64(batch_invariant_llm):
    check_alone_and_in_a_batch_of_64(batch_invariant_llm)


@pytest.mark.gpu
def test_on_a_gpu_a_seeded_request_gets_the_same_bits_alone_and_in_a_batch(batch_invariant_llm):
    assert torch.cuda.is_available()
    check_alone_and_in_a_batch_of_64(batch_invariant_llm)


def check_alone_and_in_a_batch_of_64(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, logprobs=5)
    prompt = "The quickest way to learn a language is"
    alone = _samples(llm.generate([prompt], seeded, use_tqdm=False)[0])

    rng = random.Random(5)
    vocab = llm.get_tokenizer().vocab_size
    others = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]}
        for _ in range(63)
    ]
    prompts = others[:30] + [prompt] + others[30:]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(4, 16)) for i in range(30)
    ]
    params += [seeded]
    params += [SamplingParams(temperature=0, max_tokens=rng.randint(4, 16)) for _ in range(33)]
    in_batch = _samples(llm.generate(prompts, params, use_tqdm=False)[30])

    assert in_batch[0] == alone[0]
    assert in_batch[1] == alone[1]  # every top-5 logprob, exactly
    assert len(alone[0]) == 12
