"""The traced one-row attention over gathered blocks (the float32 form) against attention
computed densely in float64 on the stored keys and values.

The pool is in the CPU's float32 layouts with every slot NaN but a sequence's own: slots
past a sequence's end, in its last block and in the blocks of a shorter sequence's padded
table row, must not reach the output, and only each row's own slot may be written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.kernels.decode_gathered_traced import gathered_blocks, write_and_attend_gathered
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, Q_HEADS = 12, 8, 2, 32, 6
SCALE = HEAD_SIZE**-0.5


def _filled(lengths: list[int], tables: np.ndarray, seed: int):
    """Float32 pools whose sequences' slots before their last hold random keys and values
    (the rest NaN), and each sequence's new query, key and value."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = (
        empty_kv_cache(*shape, torch.float32, torch.device("cpu"), layout).fill_(float("nan"))
        for layout in torch_path_layouts(torch.float32)
    )
    for row, length in enumerate(lengths):
        for position in range(length - 1):
            block, offset = tables[row, position // BLOCK_SIZE], position % BLOCK_SIZE
            for cache in (key_cache, value_cache):
                cache[block, offset] = torch.randn(KV_HEADS, HEAD_SIZE, generator=generator)
    n = len(lengths)
    new = [
        torch.randn(n, heads, HEAD_SIZE, generator=generator)
        for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    ]
    return key_cache, value_cache, new


def _attend(lengths, tables, seed, window=0):
    key_cache, value_cache, (query, key, value) = _filled(lengths, tables, seed)
    before = key_cache.clone(), value_cache.clone()
    width = -(-max(lengths) // BLOCK_SIZE)
    blocks = gathered_blocks(
        torch.from_numpy(np.ascontiguousarray(tables[:, :width])),
        torch.tensor(lengths, dtype=torch.int32),
        BLOCK_SIZE,
    )
    out = write_and_attend_gathered(
        query, key, value, key_cache, value_cache, blocks, SCALE, window
    )
    return out, (query, key, value), (key_cache, value_cache), before


@pytest.mark.parametrize(
    ("lengths", "window"),
    [
        ([1], 0),
        ([BLOCK_SIZE], 0),
        ([BLOCK_SIZE + 1], 0),
        ([3 * BLOCK_SIZE - 2], 0),
        ([5, 2 * BLOCK_SIZE + 3], 0),
        ([2 * BLOCK_SIZE + 5, 6], 1),
        ([2 * BLOCK_SIZE + 5, 6], 3),
        ([2 * BLOCK_SIZE + 5, 6], BLOCK_SIZE + 1),
        ([2 * BLOCK_SIZE + 5, 6], 100),
    ],
)
def test_gathered_attention_is_attention_over_the_stored_slots(lengths, window):
    tables = np.array([[7, 2, 9, 0], [4, 11, 1, 3]][: len(lengths)], dtype=np.int32)
    out, (query, key, value), (key_cache, value_cache), _ = _attend(
        lengths, tables, len(lengths) + window, window
    )
    assert torch.isfinite(out).all()
    group = Q_HEADS // KV_HEADS
    for row, length in enumerate(lengths):
        last = tables[row, (length - 1) // BLOCK_SIZE], (length - 1) % BLOCK_SIZE
        assert torch.equal(key_cache[last], key[row]) and torch.equal(value_cache[last], value[row])
        positions = range(max(0, length - window) if window else 0, length)
        keys, values = (
            torch.stack([cache[tables[row, p // BLOCK_SIZE], p % BLOCK_SIZE] for p in positions])
            .double()
            .repeat_interleave(group, 1)  # [L, Hq, D]
            for cache in (key_cache, value_cache)
        )
        scores = torch.einsum("hd,lhd->hl", query[row].double(), keys) * SCALE
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)


def test_only_each_rows_own_slot_is_written():
    lengths, tables = [5, 2 * BLOCK_SIZE + 3], np.array([[7, 2, 9], [4, 11, 1]], dtype=np.int32)
    _, _, caches, before = _attend(lengths, tables, seed=3)
    for cache, old in zip(caches, before, strict=True):
        changed = ~((cache == old) | (cache.isnan() & old.isnan())).all(dim=(2, 3))
        assert changed.nonzero().tolist() == [[1, 2], [7, 4]]  # (block, offset) of each last slot
