"""VLLM_ALLOW_LONG_MAX_MODEL_LEN: a --max-model-len past the model's maximum context length
is refused without it (the message names it, as vLLM's does) and taken with a warning with
it; the RoPE tables then cover the longer context, their scaling unchanged, so a tiny Llama
greedy-decodes past max_position_embeddings as transformers does; a model with learned
position embeddings (BERT) is still refused past its table. A config's model_max_length
lets a longer context through by itself, and --max-model-len auto (-1) takes the model's
context cut to what the KV cache holds."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, MistralConfig

from aioserve import LLM, SamplingParams
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.config.values import AUTO_FIT
from aioserve.engine.resolution import LONG_MAX_MODEL_LEN_ENV, resolve_max_model_len
from aioserve.models.gemma import Gemma3ForCausalLM
from aioserve.models.llama import LlamaForCausalLM
from aioserve.models.rope_parameters import fit_rope_to_context, rotary_table_length
from tests.models.tiny_models import (
    save_tiny_model,
    tiny_bert_config,
    tiny_gemma_configs,
    tiny_llama_config,
)

POSITIONS = 64  # the tiny Llama's max_position_embeddings
SERVED = 2 * POSITIONS
NEW_TOKENS = 16


def _llama_config(**fields) -> LlamaConfig:
    return tiny_llama_config(max_position_embeddings=POSITIONS, **fields)


@pytest.mark.parametrize("value", [None, "0", "false", "yes", ""])
def test_a_longer_context_is_refused_naming_the_variable(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(LONG_MAX_MODEL_LEN_ENV, raising=False)
    else:
        monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, value)
    with pytest.raises(ValueError) as refused:
        resolve_max_model_len(POSITIONS + 1, _llama_config())
    message = str(refused.value)
    assert message.startswith(
        f"--max-model-len {POSITIONS + 1} is larger than the model's maximum context length "
        f"{POSITIONS}."
    )
    assert "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in message


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " True "])
def test_the_variable_lets_a_longer_context_through_with_a_warning(monkeypatch, caplog, value):
    # vLLM's parsing: "1" or "true", any case, spaces around ignored.
    monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, value)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        assert resolve_max_model_len(SERVED, _llama_config()) == SERVED
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    expected = f"--max-model-len {SERVED} is larger than the model's maximum context length"
    assert warnings[0].startswith(expected)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution" in warnings[0]


def test_a_configs_model_max_length_lets_a_longer_context_through(monkeypatch):
    # vLLM's exception: config.json's model_max_length, where it is above the positions.
    monkeypatch.delenv(LONG_MAX_MODEL_LEN_ENV, raising=False)
    config = _llama_config(model_max_length=SERVED)
    assert resolve_max_model_len(SERVED, config) == SERVED
    fit_rope_to_context(config, SERVED)
    assert rotary_table_length(config) == SERVED
    with pytest.raises(ValueError, match=LONG_MAX_MODEL_LEN_ENV):
        resolve_max_model_len(SERVED + 1, config)


def test_the_window_cap_of_disable_sliding_window_yields_to_the_variable(monkeypatch):
    config = MistralConfig(max_position_embeddings=4096, sliding_window=1024)
    monkeypatch.delenv(LONG_MAX_MODEL_LEN_ENV, raising=False)
    assert resolve_max_model_len(2048, config) == 2048  # the window attended: no cap
    with pytest.raises(ValueError, match="maximum context length 1024. .*VLLM_ALLOW_LONG"):
        resolve_max_model_len(2048, config, disable_sliding_window=True)
    monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, "1")
    assert resolve_max_model_len(2048, config, disable_sliding_window=True) == 2048
    assert resolve_max_model_len(8192, config, disable_sliding_window=True) == 8192


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": POSITIONS // 2,
        },
    ],
    ids=["default", "dynamic", "linear", "longrope"],
)
def test_the_tables_grow_to_the_served_context_their_scaling_unchanged(scaling):
    """The table of a served context past the model's own is that model's table, longer:
    dynamic NTK's base stays fixed at the model's longest context, LongRoPE's attention
    factor stays the model's."""

    def config() -> LlamaConfig:
        rope = {} if scaling is None else {"rope_scaling": dict(scaling)}
        return _llama_config(head_dim=8, **rope)

    own_config, served_config = config(), config()
    own_length = rotary_table_length(own_config)
    fit_rope_to_context(own_config, own_length)
    fit_rope_to_context(served_config, 3 * own_length)
    assert rotary_table_length(own_config) == own_length
    assert rotary_table_length(served_config) == 3 * own_length
    own = LlamaForCausalLM(own_config).layers[0].self_attn.cos_sin_cache
    served = LlamaForCausalLM(served_config).layers[0].self_attn.cos_sin_cache
    assert own.shape == (own_length, 8)
    assert served.shape == (3 * own_length, 8)
    torch.testing.assert_close(served[:own_length], own, atol=0, rtol=0)


def test_gemma_3_tables_of_each_layer_type_grow_alike():
    own_config, served_config = (tiny_gemma_configs()["gemma3"] for _ in range(2))
    own_length = rotary_table_length(own_config)
    fit_rope_to_context(served_config, 2 * own_length)
    own, served = Gemma3ForCausalLM(own_config), Gemma3ForCausalLM(served_config)
    for own_layer, served_layer in zip(own.layers, served.layers, strict=True):
        own_table = own_layer.self_attn.cos_sin_cache
        served_table = served_layer.self_attn.cos_sin_cache
        assert served_table.shape[0] == 2 * own_table.shape[0] == 2 * own_length
        torch.testing.assert_close(served_table[:own_length], own_table, atol=0, rtol=0)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_tiny_model(_llama_config(), tmp_path_factory.mktemp("llama_64_positions"))


def test_a_tiny_llama_decodes_past_its_positions_as_transformers_does(llama_folder, monkeypatch):
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    # transformers' Llama rotates by angles computed from the positions (no table): its
    # greedy continuation past max_position_embeddings is the reference.
    hf = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    expected = tokens[len(prompt) :]

    monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, "1")
    llm = LLM(
        model=str(llama_folder),
        dtype="float32",
        max_model_len=SERVED,
        block_size=16,
        max_num_seqs=2,
        skip_tokenizer_init=True,
        enforce_eager=True,
    )
    try:
        assert llm.engine.settings.max_model_len == SERVED
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.close()
    assert list(out.outputs[0].token_ids) == expected


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A tiny BERT of 128 learned positions, which sentence-transformers caps at 64."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bert_128_positions")
    AutoModel.from_config(tiny_bert_config()).save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return folder


@pytest.mark.parametrize("value", [None, "1"])
def test_a_bert_is_refused_past_its_position_table(bert_folder, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(LONG_MAX_MODEL_LEN_ENV, raising=False)
    else:
        monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, value)
    with pytest.raises(
        ValueError,
        match="--max-model-len 129 is larger than the model's maximum context length 64: its "
        "position embeddings are a learned table of 128 positions",
    ):
        LLM(str(bert_folder), max_model_len=129, skip_tokenizer_init=True)


def test_a_bert_takes_the_variable_up_to_its_position_table(bert_folder, monkeypatch):
    monkeypatch.delenv(LONG_MAX_MODEL_LEN_ENV, raising=False)
    with pytest.raises(ValueError, match="maximum context length 64. .*VLLM_ALLOW_LONG"):
        LLM(str(bert_folder), max_model_len=128, skip_tokenizer_init=True)
    monkeypatch.setenv(LONG_MAX_MODEL_LEN_ENV, "1")
    with LLM(str(bert_folder), max_model_len=128, skip_tokenizer_init=True) as llm:
        assert llm.engine.settings.max_model_len == 128
        [out] = llm.embed([{"prompt_token_ids": list(range(2, 122))}], use_tqdm=False)
    assert out.outputs.embedding and len(out.prompt_token_ids) == 120


@pytest.mark.parametrize("value", ["-1", "auto", " AUTO ", -1])
def test_auto_and_minus_one_ask_for_the_context_that_fits(value):
    assert engine_config_from_kwargs(max_model_len=value).model.max_model_len == AUTO_FIT


@pytest.mark.parametrize("value", ["0", "-2", "automatic"])
def test_other_non_positive_lengths_are_refused(value):
    with pytest.raises(ConfigError, match="max_model_len"):
        engine_config_from_kwargs(max_model_len=value)


@pytest.mark.parametrize(("blocks", "expected"), [(None, POSITIONS), (3, 48)])
def test_auto_fit_cuts_the_context_to_the_kv_cache(llama_folder, blocks, expected, caplog):
    caplog.set_level(logging.INFO, logger="aioserve")
    engine = LLM(
        model=str(llama_folder),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        block_size=16,
        max_model_len="auto",
        num_gpu_blocks_override=blocks,
    )
    try:
        assert engine.engine.settings.max_model_len == expected
        (output,) = engine.generate(
            {"prompt_token_ids": list(range(1, expected - 4))},
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        )
        assert len(output.outputs[0].token_ids) == 5  # the context's end stops it
    finally:
        engine.close()
    assert ("reduced from" in caplog.text) == (expected < POSITIONS)
