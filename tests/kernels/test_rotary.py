"""Rotary embeddings: the cos/sin table and the neox rotation against transformers' own
LlamaRotaryEmbedding / apply_rotary_pos_emb, the GPT-J rotation against complex
multiplication, and the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from aioserve.kernels import rotary
from aioserve.kernels.rotary import apply_rotary, apply_rotary_reference, build_cos_sin_cache

_TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
BASE = 500000.0
MAX_POSITION = 4096


def _hf_rotary(head_dim: int, rope_scaling: dict | None) -> LlamaRotaryEmbedding:
    parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": BASE}
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITION,
        rope_parameters=parameters,
    )
    return LlamaRotaryEmbedding(config)


# Positions on both sides of llama3's original context and of its wavelength bands.
POSITIONS = torch.tensor([0, 1, 2, 17, 255, 256, 257, 1000, 4095])


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "default"},
        LLAMA3,
        {"rope_type": "linear", "factor": 4.0},
        YARN,  # Qwen's form: the attention factor from `factor`, a truncated band
        {**YARN, "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's attention factor
        {**YARN, "attention_factor": 1.3},
    ],
)
def test_cache_matches_transformers(rope_scaling):
    head_dim = 64
    cos, sin = _hf_rotary(head_dim, rope_scaling)(torch.zeros(1), POSITIONS[None])
    cache = build_cos_sin_cache(head_dim, MAX_POSITION, BASE, rope_scaling)
    assert cache.shape == (MAX_POSITION, head_dim)
    assert cache.dtype == torch.float32
    torch.testing.assert_close(
        cache[POSITIONS, : head_dim // 2], cos[0, :, : head_dim // 2], atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        cache[POSITIONS, head_dim // 2 :], sin[0, :, : head_dim // 2], atol=1e-6, rtol=0
    )


def test_llama3_scaling_changes_low_frequencies_only():
    plain = build_cos_sin_cache(64, 1024, BASE, None)
    scaled = build_cos_sin_cache(64, 1024, BASE, LLAMA3)
    # The highest frequency (pair 0) is kept, the lowest (pair 31) is divided by 8.
    torch.testing.assert_close(scaled[:, 0], plain[:, 0], atol=0, rtol=0)
    angles = torch.arange(1024) * (1.0 / BASE ** (62 / 64)) / 8.0
    torch.testing.assert_close(scaled[:, 31], angles.cos(), atol=1e-6, rtol=0)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    cache = build_cos_sin_cache(64, 8, BASE, {**YARN, "attention_factor": 1.5})
    # Position 0's angle is 0 in every pair: cos = the factor, sin = 0.
    torch.testing.assert_close(cache[0], torch.tensor([1.5] * 32 + [0.0] * 32))


def test_dynamic_is_transformers_at_the_longest_context_its_factor_allows():
    # transformers recomputes dynamic NTK's base from the longest position in the batch; at
    # max_position_embeddings * factor, the end of the stretched context, the two agree.
    head_dim, original, factor = 64, 1024, 4.0
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=original,
        rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": BASE},
    )
    positions = torch.tensor([0, 1, 17, 1023, 1024, 3000, 4095])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    cache = build_cos_sin_cache(head_dim, 4096, BASE, {"rope_type": "dynamic", "factor": factor})
    torch.testing.assert_close(cache[positions, :32], cos[0, :, :32], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[positions, 32:], sin[0, :, :32], atol=1e-6, rtol=0)
    # ...and differs from plain RoPE even at short positions: the base is fixed, not dynamic.
    assert not torch.allclose(cache[:1024], build_cos_sin_cache(head_dim, 1024, BASE, None))


def test_legacy_type_key_and_unknown_type():
    linear = {"rope_type": "linear", "factor": 2.0}
    legacy = {"type": "linear", "factor": 2.0}
    assert torch.equal(
        build_cos_sin_cache(32, 64, 10000.0, legacy), build_cos_sin_cache(32, 64, 10000.0, linear)
    )
    with pytest.raises(ValueError, match="'mrope'.*implements default"):
        build_cos_sin_cache(32, 64, 10000.0, {"rope_type": "mrope", "factor": 4.0})


def test_cache_dtype_and_device(device):
    cache = build_cos_sin_cache(64, 128, 10000.0, None, dtype=torch.float16, device=device)
    assert cache.dtype == torch.float16 and cache.device.type == device.type


def test_neox_reference_matches_transformers():
    head_dim = 64
    cos, sin = _hf_rotary(head_dim, LLAMA3)(torch.zeros(1), POSITIONS[None])
    query = torch.randn(len(POSITIONS), 4, head_dim)
    key = torch.randn(len(POSITIONS), 2, head_dim)
    expected_q, expected_k = apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
    cache = build_cos_sin_cache(head_dim, MAX_POSITION, BASE, LLAMA3)
    q, k = apply_rotary_reference(POSITIONS, query, key, cache, is_neox_style=True)
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(k, expected_k, atol=1e-6, rtol=0)


def test_gptj_reference_is_complex_rotation():
    # GPT-J style: each pair (x[2i], x[2i+1]) is the complex number x[2i] + i x[2i+1],
    # multiplied by exp(i * position * inv_freq[i]).
    head_dim = 32
    cache = build_cos_sin_cache(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 3, 100, 511])
    query = torch.randn(4, 3, head_dim, generator=torch.Generator().manual_seed(0))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim)
    angles = positions.double()[:, None, None] * inv_freq
    pairs = torch.view_as_complex(query.double().reshape(4, 3, head_dim // 2, 2).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles))
    q, _ = apply_rotary_reference(positions, query, query[:, :1], cache, is_neox_style=False)
    # The cache holds float32 cos/sin: at position 511 the angle itself is only known to
    # ~511 * 6e-8 radians, so a value of size ~3 may be off by ~1e-4.
    torch.testing.assert_close(q.double(), expected.reshape(4, 3, head_dim), atol=1e-4, rtol=0)


@pytest.mark.parametrize("is_neox_style", [True, False])
def test_partial_rotary_passes_the_rest_through(is_neox_style):
    # rotary_dim 32 of head 64: the first 32 dims rotate as a 32-dim head would.
    cache = build_cos_sin_cache(32, 256, 10000.0, None)
    positions = torch.tensor([5, 0, 255])
    query, key = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    q, k = apply_rotary_reference(positions, query, key, cache, is_neox_style)
    head_q, head_k = apply_rotary_reference(
        positions, query[..., :32], key[..., :32], cache, is_neox_style
    )
    assert torch.equal(q[..., :32], head_q) and torch.equal(k[..., :32], head_k)
    assert torch.equal(q[..., 32:], query[..., 32:]) and torch.equal(k[..., 32:], key[..., 32:])


@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox_style", [True, False])
def test_the_compiled_form_gives_the_eager_in_place_forms_bits(is_neox_style, dtype, rotary_dim):
    # Under torch.compile the reference rotates with one expression (_rotate_functional),
    # eagerly with in-place passes: the same products in float32, so the same bits, both
    # eagerly and as inductor compiles the expression.
    cache = build_cos_sin_cache(rotary_dim, 512, 10000.0, LLAMA3)
    gen = torch.Generator().manual_seed(rotary_dim)
    positions = torch.randint(0, 512, (37,), generator=gen)
    query = torch.randn(37, 9, 64, generator=gen).to(dtype)
    key = torch.randn(37, 3, 64, generator=gen).to(dtype)
    in_place = apply_rotary_reference(positions, query, key, cache, is_neox_style)
    cos, sin = cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    functional = [rotary._rotate_functional(x, cos, sin, is_neox_style) for x in (query, key)]
    compiled = torch.compile(apply_rotary_reference, dynamic=True)(
        positions, query, key, cache, is_neox_style
    )
    for got in (functional, compiled):
        assert torch.equal(got[0], in_place[0]) and torch.equal(got[1], in_place[1])


def _check_triton(device, dtype, num_tokens, shape, is_neox_style, cache_dtype=torch.float32):
    num_q_heads, num_kv_heads, head_size, rotary_dim = shape
    gen = torch.Generator().manual_seed(num_tokens + head_size + rotary_dim)
    cache = build_cos_sin_cache(rotary_dim, 2048, 10000.0, LLAMA3, cache_dtype, device)
    positions = torch.randint(0, 2048, (num_tokens,), generator=gen).to(device)
    # q and k are views into one fused qkv projection output, as the model produces them.
    q_size, kv_size = num_q_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    query = qkv[:, :q_size].view(num_tokens, num_q_heads, head_size)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    qkv_before = qkv.clone()

    q, k = apply_rotary(positions, query, key, cache, is_neox_style)
    expected_q, expected_k = apply_rotary_reference(positions, query, key, cache, is_neox_style)

    assert torch.equal(qkv, qkv_before)
    assert q.dtype == dtype and k.dtype == dtype
    torch.testing.assert_close(q, expected_q, **_TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **_TOLERANCE[dtype])


# (num_q_heads, num_kv_heads, head_size, rotary_dim): GQA, partial rotary, a padded head.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize(
    "shape", [(4, 4, 64, 64), (8, 2, 128, 128), (8, 1, 128, 64), (3, 1, 80, 40)]
)
def test_triton_matches_reference(triton_backend, device, dtype, is_neox_style, shape):
    _check_triton(device, dtype, 5, shape, is_neox_style)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize(
    "shape", [(32, 8, 128, 128), (9, 3, 64, 64), (28, 4, 128, 64), (16, 16, 256, 256)]
)
def test_gpu_triton_matches_reference(triton_backend, device, dtype, is_neox_style, shape):
    _check_triton(device, dtype, 300, shape, is_neox_style)
    _check_triton(device, dtype, 7, shape, is_neox_style, cache_dtype=dtype)
