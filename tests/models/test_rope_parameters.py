"""RoPE overrides (`--rope-scaling`, `--rope-theta`, the same keys in `--hf-overrides`),
`--hf-config-path`, and the context length the RoPE scaling gives, as vLLM derives it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from aioserve.engine.resolution import resolve_max_model_len
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.rope_parameters import (
    override_rope,
    rope_scaling,
    rope_theta,
    scaled_context_length,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def _config(**more) -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=1024, rope_theta=5e5, **more)


def test_a_new_scaling_keeps_the_base_and_a_new_base_keeps_the_scaling():
    config = _config()
    override_rope(config, YARN)
    assert (rope_scaling(config)["rope_type"], rope_theta(config)) == ("yarn", 5e5)
    override_rope(config, theta=1e6)
    assert rope_scaling(config)["factor"] == 4.0 and rope_theta(config) == 1e6


def test_the_legacy_type_key_and_yarns_default_original_context():
    config = _config()
    override_rope(config, {"type": "yarn", "factor": 2.0})
    scaling = rope_scaling(config)
    assert scaling["rope_type"] == "yarn" and "type" not in scaling
    assert scaling["original_max_position_embeddings"] == 1024  # as transformers defaults it


@pytest.mark.parametrize(
    "scaling, theta, words",
    [
        ({"rope_type": "mrope", "factor": 2.0}, None, "rope_type 'mrope' is not supported"),
        ({"rope_type": "longrope"}, None, "'longrope' needs short_factor, long_factor, original"),
        ({"rope_type": "linear"}, None, "'linear' needs factor"),
        ({"rope_type": "llama3", "factor": 8.0}, None, "low_freq_factor, high_freq_factor"),
        ({"rope_type": "dynamic", "factor": 0.5}, None, "factor must be a number of at least 1"),
        ("yarn", None, "must be a JSON object"),
        (None, -1.0, "rope_theta must be a number greater than 0, got -1.0"),
    ],
)
def test_bad_overrides_name_the_flag(scaling, theta, words):
    with pytest.raises(ValueError, match="^--rope-scaling: .*" + words.replace("(", r"\(")):
        override_rope(_config(), scaling, theta)


def test_hf_overrides_rope_scaling_keeps_the_base():
    # transformers 5 replaces the whole rope_parameters (base included) when rope_scaling is
    # assigned; through --hf-overrides the base must survive.
    from aioserve.models.checkpoint import apply_hf_overrides

    config = _config()
    apply_hf_overrides(config, {"rope_scaling": YARN})
    assert rope_theta(config) == 5e5 and rope_scaling(config)["factor"] == 4.0
    with pytest.raises(ValueError, match="^--hf-overrides: rope_type 'su'"):
        apply_hf_overrides(config, {"rope_scaling": {"rope_type": "su"}})


@pytest.mark.parametrize(
    "scaling, expected",
    [
        (None, 1024),
        ({"rope_type": "linear", "factor": 4.0}, 4096),
        ({"rope_type": "dynamic", "factor": 2.0}, 2048),
        ({**YARN, "original_max_position_embeddings": 512}, 2048),  # original x factor
        ({**YARN, "original_max_position_embeddings": 128}, 1024),  # already stretched
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            1024,
        ),
    ],
)
def test_the_context_the_scaling_allows(scaling, expected):
    config = _config()
    if scaling is not None:
        override_rope(config, scaling)
    assert scaled_context_length(config) == expected
    assert resolve_max_model_len(None, config) == expected
    with pytest.raises(
        ValueError, match=f"larger than the model's maximum context length {expected}"
    ):
        resolve_max_model_len(expected + 1, config)


def test_a_sliding_window_caps_the_context_only_when_disabled():
    # vLLM's meaning: the window attended, the whole context served; with
    # --disable-sliding-window the whole context attended, so the context capped at the
    # window. Qwen2's use_sliding_window: false turns the window off.
    config = MistralConfig(max_position_embeddings=4096, sliding_window=1024)
    assert resolve_max_model_len(None, config) == 4096
    assert resolve_max_model_len(None, config, disable_sliding_window=True) == 1024
    config = Qwen2Config(max_position_embeddings=4096, sliding_window=1024)
    assert resolve_max_model_len(None, config, disable_sliding_window=True) == 4096


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_theta=1e4,
    )
    folder = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_open_checkpoint_applies_the_rope_flags(tiny_folder):
    checkpoint = open_checkpoint(str(tiny_folder), rope_scaling=YARN, rope_theta=2e4)
    scaling = rope_scaling(checkpoint.hf_config)
    assert (scaling["rope_type"], scaling["factor"]) == ("yarn", 4.0)
    assert rope_theta(checkpoint.hf_config) == 2e4
    plain = open_checkpoint(str(tiny_folder)).hf_config
    assert scaled_context_length(plain) == 256 and rope_theta(plain) == 1e4


def test_hf_config_path_takes_the_config_from_another_folder(tiny_folder, tmp_path):
    other = LlamaConfig.from_pretrained(tiny_folder)
    other.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 3e4}
    other.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(str(tiny_folder), hf_config_path=str(tmp_path))
    assert rope_theta(checkpoint.hf_config) == 3e4
    assert rope_scaling(checkpoint.hf_config)["rope_type"] == "linear"
    assert len(list(checkpoint.weights())) > 0  # the weights still come from the model


def test_a_hf_config_path_without_a_config_names_the_flag(tiny_folder, tmp_path):
    with pytest.raises(ValueError, match=r"^--hf-config-path '.*': no config.json in"):
        open_checkpoint(str(tiny_folder), hf_config_path=str(tmp_path))


def test_hf_config_path_replaces_a_gguf_files_config(tmp_path):
    from tests.models.tiny_gguf import tiny_state_dict, write_tiny_gguf

    state = tiny_state_dict("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", state)
    own = open_checkpoint(str(tmp_path / "tiny.gguf")).hf_config
    own.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 4321.0}
    own.save_pretrained(tmp_path / "config")
    checkpoint = open_checkpoint(
        str(tmp_path / "tiny.gguf"), hf_config_path=str(tmp_path / "config")
    )
    assert rope_theta(checkpoint.hf_config) == 4321.0
    assert rope_scaling(checkpoint.hf_config)["rope_type"] == "dynamic"
    assert dict(checkpoint.weights()).keys() == state.keys()  # the GGUF's weights
