"""Gemma and Gemma 3 beyond the float32 parity of test_model_parity.py: 16-bit parity, the
pieces a parity test could blur (the embedding scale's rounding, GELU's tanh approximation,
each layer type's RoPE table), the configs refused, and RoPE settings per layer type."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, GemmaConfig

from aioserve.models.gemma import Gemma3ForCausalLM, GemmaForCausalLM
from aioserve.models.registry import model_class_for
from aioserve.models.rope_parameters import (
    layer_type_rope,
    override_rope,
    rope_scaling,
    scaled_context_length,
    scaling_type,
)
from tests.models.test_model_parity import assert_rows_match, hf_logits, run_schedule
from tests.models.tiny_models import COMMON, hf_and_ours, tiny_gemma_configs

CONFIGS = tiny_gemma_configs()


def test_the_architectures_are_registered():
    assert model_class_for(CONFIGS["gemma"]) is GemmaForCausalLM
    assert model_class_for(CONFIGS["gemma3"]) is Gemma3ForCausalLM


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bfloat16_reference_path_is_close_to_transformers(name):
    # As close as transformers' own bfloat16 run is to its float32 one (~0.02 and ~0.07).
    hf, ours = hf_and_ours(CONFIGS[name], dtype=torch.bfloat16)
    rows = [(s, p, row.float()) for s, p, row in run_schedule(ours, torch.bfloat16)]
    assert_rows_match(rows, hf_logits(hf), atol=8e-2, rtol=8e-2)


def test_float16_triton_path_matches_transformers(triton_backend):
    # The interpreter has no bfloat16 arithmetic: float16 stands in (bfloat16 runs on a GPU,
    # test_model_parity.py).
    hf, ours = hf_and_ours(CONFIGS["gemma3"], dtype=torch.float16)
    assert_rows_match(run_schedule(ours, torch.float16), hf_logits(hf), atol=3e-2, rtol=3e-2)


def test_the_embedding_scale_is_rounded_to_the_dtype_and_norms_hold_one_plus_weight():
    config = GemmaConfig(**{**COMMON, "hidden_size": 96}, num_key_value_heads=2, head_dim=16)
    config.architectures = ["GemmaForCausalLM"]
    hf, ours = hf_and_ours(config, dtype=torch.bfloat16)
    weight = hf.model.layers[0].input_layernorm.weight.detach().clone()  # float32
    assert ours.embed_scale == 9.8125 != math.sqrt(96)  # sqrt(96) = 9.798 in bfloat16
    ids = torch.arange(0, 256, 3)
    with torch.no_grad():
        expected = hf.to(torch.bfloat16).model.embed_tokens(ids)
    assert torch.equal(ours.embed(ids), expected)
    # 1 + w in float32, as transformers computes it, not rounded to the model's bfloat16.
    assert ours.layers[0].input_layernorm.weight.dtype == torch.float32
    assert torch.equal(ours.layers[0].input_layernorm.weight, 1.0 + weight)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_mlp_gates_with_gelus_tanh_approximation(name):
    # Inputs wide enough that GELU's tanh approximation and the exact one differ by far
    # more than the tolerance (the parity test's small activations barely tell them apart).
    hf, ours = hf_and_ours(CONFIGS[name])
    x = torch.randn(16, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0)) * 20
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x)
        got = ours.layers[0].mlp(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_each_layer_takes_its_layer_types_rope_table():
    config = CONFIGS["gemma3"]
    hf, ours = hf_and_ours(config)
    positions = torch.arange(200)[None]
    x = torch.zeros(1, 1, dtype=torch.float32)
    for index, layer_type in enumerate(config.layer_types):
        cos, sin = hf.model.rotary_emb(x, positions, layer_type)
        half = cos.shape[-1] // 2
        table = ours.layers[index].self_attn.cos_sin_cache[:200]
        torch.testing.assert_close(table, torch.cat((cos[0, :, :half], sin[0, :, :half]), -1))
    local, full = (ours.layers[i].self_attn.cos_sin_cache for i in range(2))
    assert (local[:200] - full[:200]).abs().max() > 0.5


def test_rope_settings_per_layer_type():
    config = CONFIGS["gemma3"]
    assert layer_type_rope(config, "sliding_attention") == (10_000.0, None)
    theta, scaling = layer_type_rope(config, "full_attention")
    assert (theta, scaling["rope_type"], scaling["factor"]) == (1e6, "linear", 8.0)
    # No model-wide scaling: the context is max_position_embeddings, as vLLM gives Gemma 3.
    assert rope_scaling(config) is None
    assert scaled_context_length(config) == config.max_position_embeddings
    with pytest.raises(ValueError, match="^--rope-theta: .*per layer type"):
        override_rope(config, theta=5e5, flag="--rope-theta")
    # Gemma 1's settings are one set, read as any model's.
    theta, scaling = layer_type_rope(CONFIGS["gemma"], "full_attention")
    assert (theta, scaling_type(scaling)) == (10_000.0, "default")


@pytest.mark.parametrize(
    "key, value",
    [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)],
)
def test_logit_softcapping_is_refused_by_name(key, value):
    config = Gemma3TextConfig(**COMMON, head_dim=16, architectures=["Gemma3ForCausalLM"])
    setattr(config, key, value)
    with pytest.raises(ValueError, match=f"^{key}={value} .*not supported"):
        Gemma3ForCausalLM(config)


def test_bidirectional_attention_is_refused():
    config = Gemma3TextConfig(**COMMON, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(config)


def test_activations():
    # The released Gemma configs' hidden_act "gelu" means the tanh approximation (transformers
    # 5 rewrites it so, vLLM reads it so); an exact GELU asked by name is refused.
    legacy = GemmaConfig(**COMMON, head_dim=16, hidden_act="gelu")
    GemmaForCausalLM(legacy)
    exact = Gemma3TextConfig(**COMMON, head_dim=16, hidden_activation="gelu")
    with pytest.raises(ValueError, match="unsupported activation 'gelu'"):
        Gemma3ForCausalLM(exact)
