"""`--rope-scaling` and `--rope-theta` through the whole engine: greedy tokens of a tiny
random-weight model served with the overrides equal transformers' on the same weights with
the same RoPE settings, which differ from the model's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from aioserve import LLM, SamplingParams

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
THETA = 2000.0
PROMPTS = [[5, 17, 99, 3, 42, 7, 120, 64, 8, 250, 31, 77] * 3, [200, 1, 9, 13]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        initializer_range=0.3,  # attention sharp enough for positions to change the tokens
        architectures=["Qwen2ForCausalLM"],
    )
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _transformers_greedy(folder, **config_changes) -> list[list[int]]:
    config = Qwen2Config.from_pretrained(folder)
    if config_changes:
        config.rope_parameters = {**config_changes["rope_scaling"], "rope_theta": THETA}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config).eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def test_served_tokens_follow_the_overridden_rope(tiny_folder):
    expected = _transformers_greedy(tiny_folder, rope_scaling=YARN)
    assert expected != _transformers_greedy(tiny_folder)  # the overrides change the tokens
    llm = LLM(
        model=str(tiny_folder),
        skip_tokenizer_init=True,
        dtype="float32",
        rope_scaling=YARN,
        rope_theta=THETA,
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    try:
        # YaRN's context: the original 32 tokens times 8, longer than max_position_embeddings.
        assert llm.engine.settings.max_model_len == 256
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
