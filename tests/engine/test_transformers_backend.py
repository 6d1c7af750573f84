"""The Transformers modeling backend (--model-impl, models/transformers_backend.py) through the
whole engine, against transformers' own greedy tokens and logprobs on the same weights
(float32; transformers runs its own attention there, aioserve its paged one).

Architectures aioserve does not implement, each chosen for what it exercises:
- GPT-NeoX: partial rotary, the parallel residual, a checkpoint that stores the head under
  its old name (embed_out, renamed lm_head by Transformers' conversion mapping);
- Starcoder2: grouped key/value heads, biases, and a sliding window (6 tokens, shorter
  than the prompts) passed by the layers to the paged attention;
- GPT-BigCode: one key/value head (multi-query, which the config does not state: the KV
  cache's geometry comes from probing the layers), learned positions;
- Cohere: its logit_scale applied by the backend's head.
And a Llama with a tied head, which aioserve implements, served by the backend when asked.

Each model's queries and keys are scaled up so that attention weighs positions unevenly,
and its embeddings so that the logits are peaked: a mistake in the cache, the positions or
the window then moves the logprobs far past the tolerance.
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
]
_SHAPE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=128,
    max_position_embeddings=1024,
)
CASES = {
    "gpt_neox": dict(rotary_pct=0.25, architectures=["GPTNeoXForCausalLM"]),
    "starcoder2": dict(
        num_key_value_heads=2,
        sliding_window=6,
        tie_word_embeddings=False,
        architectures=["Starcoder2ForCausalLM"],
    ),
    "gpt_bigcode": dict(
        n_embd=64,
        n_head=4,
        n_layer=2,
        tie_word_embeddings=False,
        architectures=["GPTBigCodeForCausalLM"],
    ),
    "cohere": dict(
        num_key_value_heads=2,
        logit_scale=0.5,
        tie_word_embeddings=False,
        architectures=["CohereForCausalLM"],
    ),
}
_ATTENTION_INPUTS = ("q_proj", "k_proj", "query_key_value", "c_attn")


def _tiny(folder, vocab_size: int, model_type: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **_SHAPE, **CASES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in _ATTENTION_INPUTS) and name.endswith("weight"):
                param.normal_(0, 0.5)
        model.get_input_embeddings().weight.normal_(0, 0.3)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_models(smollm2_gguf, tmp_path_factory) -> dict[str, str]:
    from aioserve.models.checkpoint import open_checkpoint

    tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
    folders = {}
    for model_type in CASES:
        folder = tmp_path_factory.mktemp(model_type)
        tokenizer.save_pretrained(folder)
        folders[model_type] = _tiny(folder, len(tokenizer), model_type)
    return folders


def _greedy(folder: str, **options) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=64, **options)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.close()


def _assert_matches_transformers(folder: str, outputs: list, varied: bool = True) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want_tokens, want_logprobs = hf_greedy(hf, prompt)
        got = output.outputs[0]
        assert list(got.token_ids) == want_tokens
        if varied:
            assert len(set(want_tokens)) > 2  # not one token over and over
        logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize("model_type", list(CASES))
def test_an_architecture_aioserve_lacks_is_served_by_the_backend(model_type, tiny_models, caplog):
    folder = tiny_models[model_type]
    with caplog.at_level(logging.INFO, logger="aioserve"):
        outputs = _greedy(folder)  # --model-impl auto
    assert "Using the Transformers modeling backend" in caplog.text
    assert "compiled the model step" not in caplog.text
    _assert_matches_transformers(folder, outputs)


def test_chunked_prompts_and_cached_prefixes(tiny_models):
    """A prompt in chunks of 16 tokens (each chunk attending to the blocks written before
    it, through the sliding window), then again from the prefix cache."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models["starcoder2"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[(i * 37 + 11) % 40000 for i in range(45)]]
    prompts.append(prompts[0][:30])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    options = dict(max_num_batched_tokens=16, enable_chunked_prefill=True, max_num_seqs=2)
    llm = LLM(model=folder, dtype="float32", block_size=16, max_model_len=128, **options)
    try:
        rounds = [
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for _ in range(2)
        ]
    finally:
        llm.close()
    for outputs in rounds:
        for prompt, output in zip(prompts, outputs, strict=True):
            want_tokens, want_logprobs = hf_greedy(hf, prompt)
            got = output.outputs[0]
            assert list(got.token_ids) == want_tokens
            logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert rounds[1][0].num_cached_tokens > 0  # the second round read the prefix cache


def test_a_native_architecture_through_the_backend_when_asked(tiny_model, caplog):
    with caplog.at_level(logging.INFO, logger="aioserve"):
        outputs = _greedy(tiny_model, model_impl="transformers")
    assert "Using the Transformers modeling backend for LlamaForCausalLM" in caplog.text
    # Its tied head repeats the last token: the logprobs carry the comparison.
    _assert_matches_transformers(tiny_model, outputs, varied=False)


def test_the_kv_cache_takes_the_probed_geometry(tiny_models):
    from aioserve.models.checkpoint import open_checkpoint
    from aioserve.models.transformers_backend import TransformersForCausalLM

    config = open_checkpoint(tiny_models["gpt_bigcode"]).hf_config
    config.head_dim = 64  # wrong, as a config may be: the layers' own calls correct it
    model = TransformersForCausalLM(config)
    assert (config.num_key_value_heads, config.head_dim) == (1, 16)
    assert [g.num_heads for g in model.layer_geometry] == [4, 4]


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("gpt_neox", {"model_impl": "vllm"}, "are not supported yet"),
        ("gguf", {"model_impl": "transformers"}, "does not serve a GGUF file yet"),
        ("minilm", {"model_impl": "transformers"}, "not a pooling model yet"),
        ("gpt_neox", {"enable_lora": True}, "has no LoRA yet"),
        ("gpt_neox", {"model_impl": "terratorch"}, "'terratorch' is not supported by aioserve"),
    ],
)
def test_what_the_backend_cannot_do_is_refused(
    model, options, message, tiny_models, smollm2_gguf, minilm_folder
):
    folder = {"gguf": str(smollm2_gguf), "minilm": str(minilm_folder)}.get(model)
    with pytest.raises(ValueError, match=message):
        LLM(model=folder or tiny_models[model], dtype="float32", max_model_len=64, **options)


def test_an_architecture_computing_its_own_attention_is_refused(tmp_path):
    from transformers import BloomConfig

    from aioserve.models.registry import model_class_for

    config = BloomConfig(architectures=["BloomForCausalLM"])
    with pytest.raises(ValueError, match="computes attention in its own code"):
        model_class_for(config, "auto")
