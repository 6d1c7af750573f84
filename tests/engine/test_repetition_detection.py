"""repetition_detection (vLLM 0.32): the check against a brute-force reference written from
its definition, vLLM's refusals, and end to end on a tiny Llama whose greedy output falls
into loops: each request ends, finish_reason "repetition" and stop_reason
"repetition_detected", exactly where transformers' greedy tokens first end with a pattern
repeated min_count times (after min_tokens), and runs to max_tokens without it.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from aioserve import LLM, SamplingParams
from aioserve.engine.repetition import RepetitionDetectionParams, ends_in_repetition
from aioserve.engine.sampling_params import FieldError
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

NEW_TOKENS = 60
PROMPTS = [list(range(start, start + 8)) for start in range(3, 40, 6)]


def repeats_reference(tokens: list[int], low: int, high: int, count: int) -> bool:
    """Some length L in [max(low, 1), high] has tokens[-count*L:] == tokens[-L:] * count."""
    for length in range(max(low, 1), high + 1):
        if length * count <= len(tokens) and tokens[-length * count :] == tokens[-length:] * count:
            return True
    return False


def first_stop(tokens: list[int], low: int, high: int, count: int, min_tokens: int = 0) -> int:
    """How many tokens the output keeps: up to the first detection at or past min_tokens."""
    for n in range(max(min_tokens, 1), len(tokens) + 1):
        if repeats_reference(tokens[:n], low, high, count):
            return n
    return len(tokens)


@pytest.mark.parametrize("seed", range(30))
def test_the_check_agrees_with_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(200):
        pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        tokens += pattern * rng.randrange(1, 5) + pattern[: rng.randrange(len(pattern) + 1)]
        high = rng.randrange(1, 6)
        low, count = rng.randrange(0, high + 1), rng.randrange(2, 5)
        params = RepetitionDetectionParams(high, low, count)
        assert ends_in_repetition(tokens, params) == repeats_reference(tokens, low, high, count), (
            tokens,
            params,
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <="),
        ({"max_pattern_size": -1}, "must be >=0"),
        ({"max_pattern_size": 3, "min_count": 1}, "min_count must be >= 2"),
        ({"max_pattern_size": 3, "min_count": 2.5}, "min_count must be an integer"),
        ({"max_pattern_size": 3, "min_count": 2, "window": 4}, "unknown field"),
    ],
)
def test_vllms_refusals_name_the_field(fields, message):
    with pytest.raises(FieldError, match=message) as refused:
        SamplingParams(repetition_detection=fields)
    assert refused.value.field == "repetition_detection"


def test_all_zero_detects_nothing():
    params = SamplingParams(repetition_detection={}).repetition_detection
    assert params == RepetitionDetectionParams()
    assert not ends_in_repetition([5] * 50, params)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def greedy(llama_folder) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    outputs = []
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize(
    ("high", "low", "count", "min_tokens"),
    [(1, 0, 4, 0), (3, 2, 3, 0), (6, 1, 2, 20), (2, 2, 9, 0)],
)
def test_requests_end_where_transformers_tokens_first_repeat(
    llama_folder, greedy, high, low, count, min_tokens
):
    detection = {"max_pattern_size": high, "min_pattern_size": low, "min_count": count}
    with LLM(
        model=str(llama_folder),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        max_num_seqs=4,
        skip_tokenizer_init=True,
        enforce_eager=True,
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(
                max_tokens=NEW_TOKENS,
                min_tokens=min_tokens,
                temperature=0.0,
                ignore_eos=True,
                repetition_detection=detection,
            ),
            use_tqdm=False,
        )
    stopped = 0
    for output, tokens in zip(outputs, greedy, strict=True):
        sample = output.outputs[0]
        kept = first_stop(tokens, low, high, count, min_tokens)
        assert sample.token_ids == tokens[:kept]
        if kept < NEW_TOKENS:
            assert (sample.finish_reason, sample.stop_reason) == (
                "repetition",
                "repetition_detected",
            )
            stopped += 1
        else:
            assert (sample.finish_reason, sample.stop_reason) == ("length", None)
    assert 0 < stopped  # the outputs loop: some stop early
