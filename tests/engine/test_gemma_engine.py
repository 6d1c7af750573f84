"""Gemma 3 through the whole engine, against transformers' greedy tokens and logprobs
(float32, the CPU step compiled as served): what it shares with Gemma 1 (the embedding
scale, the norms' 1 + weight held in float32 inside the compiled layer graphs, the GELU-tanh
MLP; Gemma 1's own layer is checked by tests/models/test_model_parity.py), its sandwich
norms, q/k norms and query_pre_attn_scalar, and its two layer types through the compiled
layer graphs: each layer's own RoPE table and sliding window (6 tokens here, shorter than
the prompts), not one layer's carried into the other.
"""

from __future__ import annotations

import logging

import pytest
import torch

from aioserve import LLM, SamplingParams
from tests.conftest import _TINY_SHAPE, _folder_with_smollm2_tokenizer
from tests.engine.test_moe_engine import NEW_TOKENS, hf_greedy

PROMPTS = [
    [504, 3575, 282, 4649, 314, 7, 9, 11, 260, 1030, 77],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 13, 14, 15, 16],
]  # both longer than Gemma 3's window
WINDOW = 6  # not a multiple of the block size: a kept block starts before the window


def _save(model, folder) -> str:
    """Scale the embeddings and q/k/v up (peaked logits, attention that weighs positions
    unevenly) and give the norms weights of their own; save into `folder`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0, 0.3)
            elif any(f"self_attn.{p}_proj" in name for p in "qkv"):
                param.normal_(0, 0.5)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_gemma3_model(smollm2_gguf, tmp_path_factory) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-gemma3"
    )
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        **_TINY_SHAPE,
        query_pre_attn_scalar=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(0)
    return _save(Gemma3ForCausalLM(config), folder)


def test_greedy_matches_transformers(tiny_gemma3_model, caplog):
    from transformers import AutoModelForCausalLM

    folder = tiny_gemma3_model
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
