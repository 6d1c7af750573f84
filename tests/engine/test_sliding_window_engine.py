"""A model with a sliding window through the whole engine, against transformers.

A tiny Mistral whose every layer sees the last 6 positions, served by `LLM` with blocks of
8 tokens, so that windows start inside blocks and whole blocks fall out of them; prompts of
11 to 16 tokens, one sharing another's first 12 (a chunk over a cached block). In float32
the greedy tokens and their logprobs must be transformers' (the layer graphs, prompts
batched). In bfloat16 (decodes weighed in the pool, the one-row graph alone) the logprobs
of the engine's own tokens, teacher-forced through transformers in float32, must be within
bfloat16's reach of them: 0.25 more than transformers' own bfloat16 run is off on the same
tokens (up to 0.75 here on an AVX2 EPYC, where the engine's worst was 0.75 too), where
served without the window they are off by 3 to 9. --disable-sliding-window caps the context at the window, as vLLM does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from aioserve import LLM, SamplingParams
from tests.conftest import _TINY_SHAPE, _folder_with_smollm2_tokenizer
from tests.engine.test_moe_engine import NEW_TOKENS, hf_greedy, hf_logprobs_of

WINDOW = 6
PROMPTS = [
    [504, 3575, 282, 4649, 314, 7, 9, 11, 260, 1030, 77],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 13, 14, 15, 16],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 400, 401],  # shares 12 tokens
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def windowed_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Mistral with a sliding window of WINDOW positions,
    an untied head, its embeddings and attention weights scaled up so that what the window
    lets through moves the logprobs (by up to 11 units here, against the whole context)."""
    from transformers import MistralConfig, MistralForCausalLM

    folder, vocab_size = _folder_with_smollm2_tokenizer(smollm2_gguf, tmp_path_factory, "swa")
    config = MistralConfig(
        vocab_size=vocab_size,
        **{**_TINY_SHAPE, "tie_word_embeddings": False},
        sliding_window=WINDOW,
        architectures=["MistralForCausalLM"],
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection, std in ((attention.q_proj, 1.0), (attention.k_proj, 1.0)):
                projection.weight.normal_(0, std)
            for projection in (attention.v_proj, attention.o_proj):
                projection.weight.normal_(0, 2.0)
        model.lm_head.weight.normal_(0, 0.2)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hf_model(windowed_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(windowed_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model_bf16(hf_model):
    return copy.deepcopy(hf_model).to(torch.bfloat16)


def _chosen(output) -> tuple[list[int], list[float]]:
    got = output.outputs[0]
    tokens = list(got.token_ids)
    return tokens, [lp[t].logprob for lp, t in zip(got.logprobs, tokens, strict=True)]


def test_float32_greedy_matches_transformers(windowed_model, hf_model):
    llm = LLM(model=windowed_model, dtype="float32", block_size=8, max_model_len=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want_tokens, want_logprobs = hf_greedy(hf_model, prompt)
        tokens, logprobs = _chosen(output)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_bfloat16_logprobs_follow_transformers_alone_and_batched(
    windowed_model, hf_model, hf_model_bf16
):
    llm = LLM(model=windowed_model, dtype="bfloat16", block_size=8, max_model_len=64)
    try:
        alone = [
            llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in PROMPTS
        ]
        batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(PROMPTS * 2, alone + batched, strict=True):
        tokens, logprobs = _chosen(output)
        expected = hf_logprobs_of(hf_model, prompt, tokens)
        reach = hf_logprobs_of(hf_model_bf16, prompt, tokens)
        for ours, want, theirs in zip(logprobs, expected, reach, strict=True):
            assert abs(ours - want) <= 0.25 + abs(theirs - want)


def test_disable_sliding_window_caps_the_context_at_the_window(windowed_model, hf_model):
    # vLLM's meaning: the whole context attended, so no context longer than the window.
    llm = LLM(model=windowed_model, dtype="float32", block_size=8, disable_sliding_window=True)
    try:
        with pytest.raises(ValueError, match=f"maximum context length.*{WINDOW}"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0)
        output = llm.generate([{"prompt_token_ids": PROMPTS[0][:4]}], params, use_tqdm=False)
    finally:
        llm.close()
    tokens, _ = _chosen(output[0])
    assert tokens == hf_greedy(hf_model, PROMPTS[0][:4])[0][:2]
