"""Llama-family variants through the whole engine, against transformers' greedy tokens and
logprobs (float32, the CPU step compiled as served):

- Phi-3's LongRoPE, served with a context longer than its original one, rotates every
  position by the long factors (rope_parameters.py `choose_longrope_factors`); the
  prompts are already past the original context, where transformers takes the long
  factors too.
- SmolLM3 leaves the rotary embedding out of the layers `no_rope_layers` marks 0: one
  compiled layer graph must not carry one layer's rotary table into another.
- GraniteMoe: Granite's multipliers (embeddings, residual adds, attention scores, logits)
  in the compiled graphs, and its stacked experts loaded from their saved names.
- Gemma 3: the embedding scale, the norms' 1 + weight held in float32 inside the compiled
  layer graphs, the GELU-tanh MLP, its sandwich and q/k norms, query_pre_attn_scalar, and
  its two layer types: each layer's own RoPE table and sliding window (6 tokens, shorter
  than the prompts), not one layer's carried into the other.
"""

from __future__ import annotations

import logging

import pytest
import torch

from aioserve import LLM, SamplingParams
from tests.engine.test_moe_engine import NEW_TOKENS, hf_greedy

PROMPTS = [
    [504, 3575, 282, 4649, 314, 7, 9, 11, 260, 1030, 77],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 13, 14, 15, 16],
]  # both longer than the Phi-3's original context of 8


@pytest.mark.parametrize(
    "model_fixture",
    ["tiny_phi3_model", "tiny_smollm3_model", "tiny_granite_moe_model", "tiny_gemma3_model"],
)
def test_greedy_matches_transformers(model_fixture, request, caplog):
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(model_fixture)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with caplog.at_level(logging.INFO, logger="aioserve"):
        llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=64)
    assert "compiled the model step" in caplog.text  # not fallen back to eager
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want_tokens, want_logprobs = hf_greedy(hf, prompt)
        got = output.outputs[0]
        assert list(got.token_ids) == want_tokens
        logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
