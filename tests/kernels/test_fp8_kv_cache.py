"""An fp8 KV cache: the write quantizes (value / scale, saturated) and attention reads it back
(stored value x scale), in the torch reference and the Triton kernels.

Oracles: torch's own float -> fp8 conversion for the write; for attention, the reference
over a float32 cache holding the dequantized values (the same numbers: tight), and over
the original float keys and values (the fp8 rounding: a tolerance from the format's
precision, below).
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.attention import paged_attention
from aioserve.kernels.attention_reference import paged_attention_reference
from aioserve.kernels.kv_cache import (
    quantize_kv,
    write_kv_cache,
    write_kv_cache_reference,
)
from tests.kernels.test_attention import _TOLERANCE, MIXED, make_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz]
_IDS = ["e4m3fn", "e5m2", "e4m3fnuz"]

# Attention over fp8 keys/values against the same over the unrounded ones: rounding to m
# mantissa bits (3 in e4m3, 2 in e5m2) moves a value by at most 2^-(m+1) of itself, and so
# a softmax mix of values by at most 2^-(m+1) of the largest; the rounded keys move the
# softmax weights too, for which 0.05 more is allowed (inputs ~N(0, 1), head size 64: the
# largest differences seen were 0.096 in e4m3, 0.244 in e5m2, against bounds of 0.34, 0.62).
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e4m3fnuz: 3, torch.float8_e5m2: 2}


def _fp8_bound(fp8: torch.dtype, values: list[torch.Tensor]) -> float:
    largest = max(float(v.abs().max()) for v in values)
    return 2.0 ** -(_MANTISSA_BITS[fp8] + 1) * largest + 0.05


def _scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k]), torch.tensor([v])


def _fp8_batch(fp8: torch.dtype, dtype: torch.dtype, k_scale: float, v_scale: float, **shape):
    """make_batch's float batch, and its caches quantized to `fp8` (free slots stay NaN)."""
    batch = make_batch(MIXED, dtype=dtype, device=torch.device("cpu"), **shape)
    scales = _scales(k_scale, v_scale)
    key_cache = quantize_kv(batch.key_cache, scales[0], fp8)
    value_cache = quantize_kv(batch.value_cache, scales[1], fp8)
    return batch, key_cache, value_cache, scales


def _args(batch, key_cache, value_cache) -> tuple:
    args = list(batch.args())
    args[1], args[2] = key_cache, value_cache
    return tuple(args)


def _write_inputs(dtype: torch.dtype, fp8: torch.dtype, scale: float):
    """Keys and values whose quotients by `scale` are fp8 numbers (so the write rounds
    nothing), a few far past the format's range (so it saturates); every third slot -1."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, heads, head_size, block_size, num_blocks = 9, 2, 32, 4, 6
    finite = torch.finfo(fp8).max

    def exact() -> torch.Tensor:
        bits = torch.randint(0, 256, (num_tokens, heads, head_size), generator=gen)
        values = bits.to(torch.uint8).view(fp8).float()
        values = torch.where(values.isfinite(), values, 1.0)
        values[0, 0, :3] = torch.tensor([4 * finite, -4 * finite, 1e30])
        return (values * scale).to(dtype)

    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    shape = (num_blocks, block_size, heads, head_size)
    return exact(), exact(), torch.zeros(shape, dtype=fp8), torch.zeros(shape, dtype=fp8), slots


@pytest.mark.parametrize("fp8", FP8, ids=_IDS)
def test_reference_write_quantizes_and_saturates(fp8):
    key, value, key_cache, value_cache, slots = _write_inputs(torch.float32, fp8, 0.5)
    key[1, 0, 0] = float("inf")
    k_scale, v_scale = _scales(0.5, 2.0)
    write_kv_cache_reference(key, value, key_cache, value_cache, slots, True, k_scale, v_scale)
    finite = torch.finfo(fp8).max
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slots.tolist()):
        where = (slot // block_size, slot % block_size)
        if slot < 0:
            continue
        for cache, x, scale in ((key_cache, key, 0.5), (value_cache, value, 2.0)):
            expected = (x[token] / scale).clamp(-finite, finite).to(fp8)
            assert torch.equal(cache[where].view(torch.uint8), expected.view(torch.uint8))
    written = slots[slots >= 0]
    untouched = torch.ones(key_cache.shape[0] * block_size, dtype=torch.bool)
    untouched[written] = False
    assert not key_cache.view(-1, *key_cache.shape[2:])[untouched].view(torch.uint8).any()
    assert key_cache.float().isfinite().all() and value_cache.float().isfinite().all()
    assert key_cache.float().abs().max() == finite  # the 4x, 1e30 and inf saturated


def test_fp8_cache_without_scales_is_refused():
    key, value, key_cache, value_cache, slots = _write_inputs(
        torch.float32, torch.float8_e4m3fn, 1.0
    )
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        write_kv_cache_reference(key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", FP8, ids=_IDS)
def test_triton_write_matches_reference(triton_backend, fp8, dtype):
    # Exactly representable quotients: the interpreter's float -> fp8 conversion rounds
    # wrongly where the mantissa carries into the exponent (1.97 -> 1.0 in e5m2); a GPU
    # converts in hardware (the gpu-marked tests).
    key, value, key_cache, value_cache, slots = _write_inputs(dtype, fp8, 0.25)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    k_scale, v_scale = _scales(0.25, 0.25)
    write_kv_cache_reference(
        key, value, expected_keys, expected_values, slots, True, k_scale, v_scale
    )
    write_kv_cache(key, value, key_cache, value_cache, slots, True, k_scale, v_scale)
    assert torch.equal(key_cache.view(torch.uint8), expected_keys.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_values.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=_IDS)
def test_reference_reads_fp8_as_its_values_times_the_scales(fp8):
    batch, key_cache, value_cache, scales = _fp8_batch(
        fp8, torch.float32, 1 / 32, 1 / 16, num_q_heads=4, num_kv_heads=2, head_size=64,
        block_size=8,
    )  # fmt: skip
    out = paged_attention_reference(*_args(batch, key_cache, value_cache), None, None, *scales)
    assert out.isfinite().all()  # the NaN of the free slots never reaches a row
    # The same numbers in a float32 cache (NaN where they were).
    dequantized = _args(batch, key_cache.float() * scales[0], value_cache.float() * scales[1])
    torch.testing.assert_close(
        out, paged_attention_reference(*dequantized), **_TOLERANCE[torch.float32]
    )
    # Against the keys and values before rounding: fp8's precision.
    exact = paged_attention_reference(*batch.args())
    torch.testing.assert_close(out, exact, atol=_fp8_bound(fp8, batch.values), rtol=0)
    assert (out - exact).abs().max() > 0  # rounded, not read as the originals


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", FP8, ids=_IDS)
def test_triton_attention_over_fp8_matches_reference(triton_backend, fp8, dtype):
    batch, key_cache, value_cache, scales = _fp8_batch(
        fp8, dtype, 1 / 32, 1 / 8, num_q_heads=4, num_kv_heads=1, head_size=64, block_size=16
    )
    args = _args(batch, key_cache, value_cache)
    out = paged_attention(*args, None, None, *scales)
    assert out.dtype == dtype and out.isfinite().all()
    expected = paged_attention_reference(*args, None, None, *scales)
    torch.testing.assert_close(out, expected, **_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=_IDS)
def test_gpu_write_and_attention_match_reference(triton_backend, device, fp8):
    # On a GPU the conversion rounds in hardware: random values, bytes equal but for ties.
    if fp8 == torch.float8_e4m3fnuz and torch.version.hip is None:
        pytest.skip("e4m3fnuz is ROCm's format")
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(500, 8, 128, generator=gen).to(torch.bfloat16).to(device)
    value = torch.randn(500, 8, 128, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(64 * 16, generator=gen)[:500].to(device)
    caches = [torch.zeros((64, 16, 8, 128), dtype=fp8, device=device) for _ in range(4)]
    k_scale, v_scale = (s.to(device) for s in _scales(0.02, 0.03))
    write_kv_cache_reference(key, value, caches[0], caches[1], slots, True, k_scale, v_scale)
    write_kv_cache(key, value, caches[2], caches[3], slots, True, k_scale, v_scale)
    for ours, expected in ((caches[2], caches[0]), (caches[3], caches[1])):
        torch.testing.assert_close(ours.float(), expected.float(), atol=0, rtol=2**-3)
    batch, key_cache, value_cache, scales = _fp8_batch(
        fp8, torch.bfloat16, 1 / 32, 1 / 8, num_q_heads=8, num_kv_heads=2, head_size=128,
        block_size=16,
    )  # fmt: skip
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                 for a in _args(batch, key_cache, value_cache))  # fmt: skip
    scales = tuple(s.to(device) for s in scales)
    out = paged_attention(*args, None, None, *scales)
    expected = paged_attention_reference(*args, None, None, *scales)
    torch.testing.assert_close(out, expected, **_TOLERANCE[torch.bfloat16])
