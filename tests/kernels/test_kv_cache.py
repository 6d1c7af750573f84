"""write_kv_cache: the torch reference against a per-token loop, the Triton kernel against
the reference (a pure copy, so exactly), into caches stored in each layout of
`empty_kv_cache`: slot-major (a GPU's pool), head-major (the CPU's values) and dim-major
(the CPU's keys)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.kernels.attention_reference import plan_reference_attention
from aioserve.kernels.kv_cache import empty_kv_cache, write_kv_cache, write_kv_cache_reference
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.runner.step_inputs import HostStepInputs


def _inputs(
    device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks, layout="slot_major"
):
    gen = torch.Generator().manual_seed(num_tokens * block_size + head_size)
    # key and value are views into one fused qkv tensor, as the model produces them.
    kv_size = num_kv_heads * head_size
    qkv = torch.randn(num_tokens, 3 * kv_size, generator=gen).to(dtype).to(device)
    key = qkv[:, kv_size : 2 * kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * kv_size :].view(num_tokens, num_kv_heads, head_size)
    # Distinct slots anywhere in the pool, and every third token padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = []
    for _ in range(2):
        cache = empty_kv_cache(*cache_shape, dtype, torch.device(device), layout)
        caches.append(cache.copy_(torch.randn(cache_shape, generator=gen)))
    return key, value, *caches, slots.to(device)


@pytest.mark.parametrize(
    "layout, strides",
    [
        ("slot_major", (16 * 3 * 8, 3 * 8, 8, 1)),
        ("head_major", (3 * 16 * 8, 8, 16 * 8, 1)),  # a kv head's slots, then the next head
        ("dim_major", (3 * 8 * 16, 1, 8 * 16, 16)),  # a component's slots are one run
    ],
)
def test_each_layout_is_stored_in_its_order(layout, strides):
    cache = empty_kv_cache(5, 16, 3, 8, torch.float32, torch.device("cpu"), layout)
    assert cache.shape == (5, 16, 3, 8)
    assert cache.stride() == strides


@pytest.mark.parametrize("layout", ["slot_major", "head_major", "dim_major"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_matches_loop(device, block_size, layout):
    key, value, key_cache, value_cache, slots = _inputs(
        device, torch.float32, 10, 2, 8, block_size, 12, layout
    )
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_keys[slot // block_size, slot % block_size] = key[token]
            expected_values[slot // block_size, slot % block_size] = value[token]
    write_kv_cache_reference(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


@pytest.mark.parametrize("skips_tokens", [True, False])
def test_the_steps_write_index_writes_the_same_slots(device, skips_tokens):
    # The step's plan works out each slot's (block, offset) once for every layer's write.
    key, value, key_cache, value_cache, slots = _inputs(
        device, torch.float32, 10, 2, 8, 4, 12, "dim_major"
    )
    if not skips_tokens:
        written = slots >= 0
        key, value, slots = key[written], value[written], slots[written]
    plan = plan_reference_attention(
        np.array([0, len(slots)]),
        np.array([len(slots)]),
        np.zeros((1, 1), dtype=np.int32),
        4,
        torch.device(device),
        slots.cpu().numpy(),
    )
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    write_kv_cache_reference(key, value, expected_keys, expected_values, slots, skips_tokens)
    write_kv_cache_reference(
        key, value, key_cache, value_cache, slots, skips_tokens, slot_index=plan.write_index
    )
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)


def test_a_step_without_padding_skips_the_check_and_writes_the_same(device):
    key, value, key_cache, value_cache, slots = _inputs(device, torch.float32, 9, 2, 8, 4, 6)
    written = slots >= 0
    key, value, slots = key[written], value[written], slots[written]
    checked_keys, checked_values = key_cache.clone(), value_cache.clone()
    write_kv_cache_reference(key, value, checked_keys, checked_values, slots)
    write_kv_cache_reference(key, value, key_cache, value_cache, slots, skips_tokens=False)
    assert torch.equal(key_cache, checked_keys) and torch.equal(value_cache, checked_values)
    assert not torch.equal(key_cache, _inputs(device, torch.float32, 9, 2, 8, 4, 6)[2])


def test_step_inputs_say_whether_a_slot_is_skipped():
    def meta(slot_mapping):
        host = HostStepInputs(
            input_ids=np.zeros(2, dtype=np.int64),
            placeholder_rows=np.zeros(0, dtype=np.int64),
            placeholder_slots=np.zeros(0, dtype=np.int64),
            positions=np.zeros(2, dtype=np.int64),
            slot_mapping=np.asarray(slot_mapping, dtype=np.int64),
            query_start_loc=np.array([0, 1, 2], dtype=np.int32),
            seq_lens=np.ones(2, dtype=np.int32),
            block_tables=np.zeros((2, 1), dtype=np.int32),
            logits_indices=np.array([0, 1], dtype=np.int64),
            max_query_len=1,
            max_seq_len=1,
            attention_plan=None,
        )
        return host.to_device(torch.device("cpu"), torch.zeros(1, dtype=torch.int64)).attention

    assert meta([3, 7]).skips_kv_writes is False
    assert meta([3, -1]).skips_kv_writes is True
    assert AttentionMetadata.without_kv_writes(2, torch.device("cpu")).skips_kv_writes is True


def test_reference_casts_to_cache_dtype(device):
    key, value, key_cache, value_cache, slots = _inputs(device, torch.float32, 4, 1, 16, 8, 2)
    key_cache, value_cache = key_cache.half(), value_cache.half()
    write_kv_cache_reference(key, value, key_cache, value_cache, slots)
    written = slots[slots >= 0]
    torch.testing.assert_close(
        key_cache.flatten(0, 1)[written], key[slots >= 0].half(), atol=0, rtol=0
    )


def _check_triton(
    device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks, layout="slot_major"
):
    key, value, key_cache, value_cache, slots = _inputs(
        device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks, layout
    )
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    write_kv_cache_reference(key, value, expected_keys, expected_values, slots)
    write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_size, block_size, num_blocks",
    [(7, 2, 64, 16, 3), (9, 1, 128, 8, 4), (5, 3, 80, 1, 9), (12, 8, 64, 32, 2)],
)
def test_triton_matches_reference(
    triton_backend, device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks
):
    _check_triton(device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks)


def test_triton_writes_a_head_major_cache(triton_backend, device):
    _check_triton(device, torch.float16, 7, 3, 64, 16, 3, layout="head_major")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_size, block_size, num_blocks",
    [(1000, 8, 128, 16, 100), (3, 3, 64, 16, 1000), (257, 2, 256, 32, 20)],
)
def test_gpu_triton_matches_reference(
    triton_backend, device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks
):
    _check_triton(device, dtype, num_tokens, num_kv_heads, head_size, block_size, num_blocks)
