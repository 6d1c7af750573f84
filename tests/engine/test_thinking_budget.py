"""thinking_token_budget end to end: a tiny Llama with SmolLM2's tokenizer, against
transformers' greedy loop with vLLM 0.32's rule written as a transformers LogitsProcessor.

Two ways to name the markers: --reasoning-parser deepseek_r1 (`<think>` and `</think>`,
several tokens each in this vocabulary), with prompts that open a thought; and
--reasoning-config with a start marker this model writes itself, so that thoughts open in
the output. Requests with and without budgets run together, five at a time over little
KV cache with prompts chunked (preemptions happen), with async scheduling on and off, and
beside n-gram speculative decoding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import LogitsProcessor as HFLogitsProcessor

from aioserve import LLM, SamplingParams
from aioserve.engine.admission import InvalidRequest
from aioserve.runner.thinking_budget import ThinkingMarkers
from tests.runner.test_thinking_budget import reference_forced_token

NEW_TOKENS = 16
BUDGETS = [0, 3, None, 5, 1, 8, None]


class ThinkingBudgetRule(HFLogitsProcessor):
    def __init__(self, budget: int, markers: ThinkingMarkers):
        self.budget, self.markers = budget, markers

    def __call__(self, input_ids, scores):
        token = reference_forced_token(input_ids[0].tolist(), self.budget, self.markers)
        if token is not None:
            scores[0] = float("-inf")
            scores[0, token] = 0.0
        return scores


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _generate(hf_model, prompt: list[int], rules: list) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        logits_processor=rules,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _prompts(think: tuple[int, ...]) -> list[list[int]]:
    base = [
        list(range(40 + 7 * i, 40 + 7 * i + n)) for i, n in enumerate((23, 9, 31, 14, 5, 27, 18))
    ]
    return [p + list(think) if i % 3 != 1 else p for i, p in enumerate(base)]


def _llm(model: str, **more) -> LLM:
    return LLM(
        model=model,
        dtype="float32",
        max_model_len=128,
        block_size=16,
        max_num_seqs=5,
        enforce_eager=True,
        **more,
    )


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [
        SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, thinking_token_budget=b
        )
        for b in BUDGETS
    ]
    return _run_params(llm, prompts, params)


def _run_params(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _expected(hf_model, prompts, markers: ThinkingMarkers) -> list[list[int]]:
    return [
        _generate(hf_model, p, [] if b is None else [ThinkingBudgetRule(b, markers)])
        for p, b in zip(prompts, BUDGETS, strict=True)
    ]


@pytest.mark.parametrize(
    "engine",
    [
        dict(async_scheduling=False),
        dict(async_scheduling=True, max_num_batched_tokens=32, num_gpu_blocks_override=8),
        dict(async_scheduling=False, max_num_batched_tokens=32, num_gpu_blocks_override=8),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    ],
    ids=["sync", "async-preempted", "sync-preempted", "ngram"],
)
def test_deepseek_r1_markers_cut_each_thought_at_its_budget(
    tiny_model, hf_model, tokenizer, engine
):
    think, end = _encode(tokenizer, "<think>"), _encode(tokenizer, "</think>")
    assert len(think) > 1 and len(end) > 1  # markers of several tokens
    markers = ThinkingMarkers(think, end, end)
    prompts = _prompts(think)
    expected = _expected(hf_model, prompts, markers)
    with _llm(tiny_model, reasoning_parser="deepseek_r1", **engine) as llm:
        got = _run(llm, prompts)
        if "num_gpu_blocks_override" in engine:
            assert llm.engine.scheduler.stats.num_preemptions > 0
    assert got == expected
    # Budget 0 with an open thought: the end marker at once; 5: after five tokens.
    assert got[0][: len(end)] == list(end)
    assert got[1] == _generate(hf_model, prompts[1], [])  # no thought opened: untouched
    assert got[2] == _generate(hf_model, prompts[2], [])  # no budget
    free = _generate(hf_model, prompts[3], [])
    assert (
        got[3][:5] == free[:5] and got[3][5 : 5 + len(end)] == list(end) != free[5 : 5 + len(end)]
    )


def test_thoughts_a_sampling_model_opens_itself_are_cut_by_the_rule(tiny_model, tokenizer):
    """Seeded sampling draws the same token at the same index whatever else happens, so
    the budgeted output is the free one up to the first forced token; from there on
    every token is the rule's wherever the rule forces one."""
    prompt = list(range(40, 63))
    free_params = SamplingParams(max_tokens=32, temperature=2.0, seed=11, ignore_eos=True)
    with _llm(tiny_model) as llm:
        [free] = _run_params(llm, [prompt], [free_params])
    # The start marker: a token written in the output, not in the prompt, early on.
    start = next(
        t for t in free[1:8]
        if t not in prompt and _encode(tokenizer, tokenizer.decode([t])) == (t,)
    )  # fmt: skip
    end = _encode(tokenizer, "</think>")
    markers = ThinkingMarkers((start,), end, end)
    config = {"reasoning_start_str": tokenizer.decode([start]), "reasoning_end_str": "</think>"}
    budgeted = dataclasses.replace(free_params, thinking_token_budget=2)
    with _llm(tiny_model, reasoning_config=config) as llm:
        [got] = _run_params(llm, [prompt], [budgeted])
    forced_at = [j for j in range(len(got)) if reference_forced_token(prompt + got[:j], 2, markers)]
    for j in forced_at:
        assert got[j] == reference_forced_token(prompt + got[:j], 2, markers)
    first = free.index(start) + 3  # the start marker, then two tokens of thought
    assert forced_at[0] == first and got[:first] == free[:first]
    assert got[first : first + len(end)] == list(end)


def test_a_budget_without_reasoning_markers_is_refused_as_vllm_refuses_it(tiny_model):
    with _llm(tiny_model) as llm:
        with pytest.raises(InvalidRequest, match="reasoning_config is not configured") as refused:
            llm.generate(
                [{"prompt_token_ids": [5, 6, 7]}],
                SamplingParams(max_tokens=2, thinking_token_budget=4),
                use_tqdm=False,
            )
        assert refused.value.param == "thinking_token_budget"


@pytest.mark.parametrize("value", [-2, 1.5, True, "4"])
def test_vllms_refusals_of_a_budget(value):
    with pytest.raises(ValueError, match="must be a non-negative integer or -1 for unlimited"):
        SamplingParams(thinking_token_budget=value)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
