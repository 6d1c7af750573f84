"""Rotary embedding and the KV-cache write in one launch (aioserve/kernels/rotary_kv_write.py)
against `apply_rotary` then `write_kv_cache` (its reference): the rotated queries and keys,
and every byte of both caches, in the cache layouts a GPU's pool takes, neox and GPT-J pairs, partial rotary,
padding slots, fp8 caches. Under TRITON_INTERPRET=1 (the test session's setting) in
float16 and float32; `pytest -m gpu` runs bfloat16 compiled.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.kv_cache import empty_kv_cache, write_kv_cache_reference
from aioserve.kernels.rotary import apply_rotary_reference, build_cos_sin_cache
from aioserve.kernels.rotary_kv_write import rotary_and_write_kv, rotary_and_write_kv_triton


def _inputs(dtype, cache_dtype, layout, head_size, rotary_dim, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_q_heads, num_kv_heads, block_size, num_blocks = 7, 6, 2, 4, 5
    q_size, kv_size = num_q_heads * head_size, num_kv_heads * head_size
    # query, key and value are views into one fused qkv tensor, as the model makes them.
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(device, dtype)
    query = qkv[:, :q_size].view(num_tokens, num_q_heads, head_size)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(device)
    cos_sin = build_cos_sin_cache(rotary_dim, 64, 10000.0, None, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens: nothing written
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = []
    for _ in range(2):
        cache = empty_kv_cache(*shape, cache_dtype, torch.device(device), layout)
        cache.copy_(torch.randn(shape, generator=gen).to(cache_dtype))
        caches.append(cache)
    scales = {}
    if cache_dtype.itemsize == 1:
        scales = {"k_scale": torch.tensor([0.5], device=device), "v_scale": torch.tensor([2.0])}
        # Values that are fp8 numbers times their scale: the write divides exactly and
        # rounds nothing, so the value cache is compared bit for bit.
        value.copy_((value / 2.0).to(cache_dtype).to(dtype) * 2.0)
    return positions, query, key, value, cos_sin, caches, slots.to(device), scales


def _both_ways(dtype, cache_dtype, layout, head_size, rotary_dim, is_neox):
    """The fused launch and its reference on copies of the same caches."""
    positions, query, key, value, cos_sin, caches, slots, scales = _inputs(
        dtype, cache_dtype, layout, head_size, rotary_dim, "cpu"
    )
    got_caches = [cache.clone() for cache in caches]
    got = rotary_and_write_kv_triton(
        positions, query, key, value, cos_sin, *got_caches, slots, is_neox, **scales
    )
    expected = apply_rotary_reference(positions, query, key, cos_sin, is_neox)
    write_kv_cache_reference(expected[1], value, *caches, slots, **scales)
    return got, got_caches, expected, caches


def _assert_caches_equal(got, expected):
    for mine, theirs in zip(got, expected, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["slot_major", "head_major"])  # as the GPU pool may be
@pytest.mark.parametrize("is_neox", [True, False])
def test_one_launch_gives_the_rotary_and_the_write(triton_backend, dtype, layout, is_neox):
    (query, key), caches, (ref_query, ref_key), ref_caches = _both_ways(
        dtype, dtype, layout, 16, 16, is_neox
    )
    torch.testing.assert_close(query, ref_query, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(key, ref_key, rtol=1e-3, atol=1e-3)
    # The cache holds exactly the returned keys, and the values as they came.
    keys_written = caches[0].clone()
    _assert_caches_equal(caches[1:], ref_caches[1:])
    torch.testing.assert_close(keys_written, ref_caches[0], rtol=1e-3, atol=1e-3)


def test_partial_rotary_copies_the_rest_of_each_head(triton_backend):
    (query, key), caches, (ref_query, ref_key), ref_caches = _both_ways(
        torch.float32, torch.float32, "slot_major", 24, 8, True
    )
    torch.testing.assert_close(query, ref_query, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(key, ref_key, rtol=1e-5, atol=1e-5)
    assert torch.equal(query[..., 8:], ref_query[..., 8:])  # passed through untouched
    torch.testing.assert_close(caches[0], ref_caches[0], rtol=1e-5, atol=1e-5)
    _assert_caches_equal(caches[1:], ref_caches[1:])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_gets_the_scaled_saturated_values(triton_backend, cache_dtype):
    # float32 activations: the rotated keys agree to float32 rounding, so their fp8 codes
    # agree to within one step where a value sits on a rounding boundary. Triton's
    # interpreter loses the carry of a cast that rounds up to a power of two (126.4 became
    # 64, not 128: fp8_linear.py), so such a code may be half the reference's here.
    (_, key), caches, (_, ref_key), ref_caches = _both_ways(
        torch.float32, cache_dtype, "slot_major", 16, 16, True
    )
    torch.testing.assert_close(key, ref_key, rtol=1e-5, atol=1e-5)
    got, expected = caches[0].float(), ref_caches[0].float()
    close = torch.isclose(got, expected, rtol=0.15, atol=0.0)
    carry_lost = (got * 2 == expected) & (torch.frexp(expected).mantissa.abs() == 0.5)
    assert (close | carry_lost).all()
    assert close.float().mean() > 0.95
    _assert_caches_equal(caches[1:], ref_caches[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_on_a_gpu_one_launch_gives_the_rotary_and_the_write(dtype):
    positions, query, key, value, cos_sin, caches, slots, _ = _inputs(
        dtype, dtype, "slot_major", 128, 128, "cuda"
    )
    got_caches = [cache.clone() for cache in caches]
    got = rotary_and_write_kv_triton(
        positions, query, key, value, cos_sin, *got_caches, slots, True
    )
    from aioserve.kernels.kv_cache import write_kv_cache_reference
    from aioserve.kernels.rotary import apply_rotary_reference

    expected = apply_rotary_reference(positions, query, key, cos_sin, True)
    write_kv_cache_reference(expected[1], value, *caches, slots)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_caches[0], caches[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(got_caches[1], caches[1])


def test_the_cpu_runs_the_two_references():
    positions, query, key, value, cos_sin, caches, slots, _ = _inputs(
        torch.float32, torch.float32, "head_major", 16, 16, "cpu"
    )
    expected_caches = [cache.clone() for cache in caches]
    got = rotary_and_write_kv(positions, query, key, value, cos_sin, *caches, slots, True)
    expected = apply_rotary_reference(positions, query, key, cos_sin, True)
    write_kv_cache_reference(expected[1], value, *expected_caches, slots)
    for mine, theirs in zip([*got, *caches], [*expected, *expected_caches], strict=True):
        assert torch.equal(mine, theirs)
