"""The traced one-row attention writes and attends as the custom op's path does.

`write_and_attend` (the form a compiled whole step traces) against the KV write and
`attend_in_pool` of the layer graphs, bit for bit, on the CPU pool layouts; slots past a
sequence's end hold NaN and must not reach the output. Then against attention computed
densely in float64 on the same stored keys and values. In bfloat16 and in float32 (read in
place on a CPU without AVX-512).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.kernels import decode_in_pool
from aioserve.kernels.decode_in_pool_traced import rows_in_pool, write_and_attend
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts, write_kv_cache

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, Q_HEADS = 12, 8, 2, 32, 6
SCALE = HEAD_SIZE**-0.5


# The dtypes whose pools are weighed in place: bfloat16, and float32 on a CPU without AVX-512.
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


def _pools(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of `dtype` in the layouts read in place, every slot NaN."""
    key_layout, value_layout = torch_path_layouts(torch.bfloat16)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    pools = [
        empty_kv_cache(*shape, dtype, torch.device("cpu"), layout).fill_(float("nan"))
        for layout in (key_layout, value_layout)
    ]
    return pools[0], pools[1]


def _filled(lengths: list[int], tables: np.ndarray, seed: int, dtype: torch.dtype):
    """Pools whose sequences' slots before their last hold random keys and values (the
    rest NaN), and each sequence's new query, key and value."""
    generator = torch.Generator().manual_seed(seed)
    key_cache, value_cache = _pools(dtype)
    for row, length in enumerate(lengths):
        for position in range(length - 1):
            block, offset = tables[row, position // BLOCK_SIZE], position % BLOCK_SIZE
            for cache in (key_cache, value_cache):
                cache[block, offset] = torch.randn(KV_HEADS, HEAD_SIZE, generator=generator).to(
                    dtype
                )
    n = len(lengths)
    new = [
        torch.randn(n, heads, HEAD_SIZE, generator=generator).to(dtype)
        for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    ]
    return key_cache, value_cache, new


def _custom_op_path(query, key, value, key_cache, value_cache, tables, lengths):
    """The layer graphs' way: write_kv_cache, then attend_in_pool over the group's bags."""
    lengths = np.asarray(lengths)
    slots = np.array(
        [
            tables[i, (n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
            for i, n in enumerate(lengths)
        ]
    )
    write_kv_cache(key, value, key_cache, value_cache, torch.from_numpy(slots), False)
    blocks = -(-lengths.max() // BLOCK_SIZE)
    masked = [
        (row * Q_HEADS + head) * blocks * BLOCK_SIZE + position
        for row, n in enumerate(lengths)
        for head in range(Q_HEADS)
        for position in range(n, blocks * BLOCK_SIZE)
    ]
    bags = decode_in_pool.pool_bags(
        tables[:, :blocks].astype(np.int64),
        lengths,
        int(lengths.max()),
        key_cache,
        value_cache,
        Q_HEADS,
        np.array(masked) if masked else None,
    )
    return decode_in_pool.attend_in_pool(query, key_cache, value_cache, bags, SCALE)


def _rows(tables: np.ndarray, lengths: list[int], key_cache, value_cache):
    """rows_in_pool on a step's metadata: the block table as wide as the longest needs."""
    blocks = -(-max(lengths) // BLOCK_SIZE)
    return rows_in_pool(
        torch.from_numpy(np.ascontiguousarray(tables[:, :blocks])),
        torch.tensor(lengths, dtype=torch.int32),
        key_cache,
        value_cache,
        Q_HEADS,
    )


def test_rows_in_pool_are_the_custom_op_paths_rows():
    lengths, tables = [5, 2 * BLOCK_SIZE + 3], np.array([[7, 2, 9], [4, 11, 1]], dtype=np.int32)
    key_cache, value_cache = _pools()
    rows = _rows(tables, lengths, key_cache, value_cache)
    blocks = tables.astype(np.int64)
    keys = decode_in_pool.key_rows(blocks, key_cache, Q_HEADS)
    values = decode_in_pool.value_rows(
        blocks, np.array(lengths), 3 * BLOCK_SIZE, value_cache, Q_HEADS
    )
    assert rows.key_rows.flatten(0, 2).tolist() == keys.tolist()
    assert rows.value_rows.flatten(2).flatten(0, 1).tolist() == values.tolist()
    assert rows.write_blocks.tolist() == [7, 1] and rows.write_offsets.tolist() == [4, 2]
    assert rows.lengths.tolist() == [[5], [2 * BLOCK_SIZE + 3]]


@DTYPES
@pytest.mark.parametrize(
    "lengths", [[1], [BLOCK_SIZE], [BLOCK_SIZE + 1], [3 * BLOCK_SIZE - 2], [5, 2 * BLOCK_SIZE + 3]]
)
def test_write_and_attend_equals_the_custom_op_path_bit_for_bit(lengths, dtype):
    tables = np.array([[7, 2, 9, 0], [4, 11, 1, 3]][: len(lengths)], dtype=np.int32)
    key_cache, value_cache, (query, key, value) = _filled(
        lengths, tables, seed=len(lengths), dtype=dtype
    )
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected = _custom_op_path(query, key, value, expected_keys, expected_values, tables, lengths)
    rows = _rows(tables, lengths, key_cache, value_cache)
    out = write_and_attend(query, key, value, key_cache, value_cache, rows, SCALE)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # The same slots written, and only those (NaN compares unequal, hence equal_nan).
    torch.testing.assert_close(key_cache, expected_keys, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_values, rtol=0, atol=0, equal_nan=True)


@DTYPES
@pytest.mark.parametrize("window", [0, 1, 3, BLOCK_SIZE + 1, 100])
def test_write_and_attend_is_attention_over_the_stored_slots(window, dtype):
    # A sliding window W > 0 keeps each row to its last W slots, its own included.
    lengths = [2 * BLOCK_SIZE + 5, 6]
    tables = np.array([[3, 10, 6], [8, 0, 0]], dtype=np.int32)
    key_cache, value_cache, (query, key, value) = _filled(lengths, tables, seed=7, dtype=dtype)
    rows = _rows(tables, lengths, key_cache, value_cache)
    out = write_and_attend(query, key, value, key_cache, value_cache, rows, SCALE, window)
    group = Q_HEADS // KV_HEADS
    for row, length in enumerate(lengths):
        positions = range(max(0, length - window) if window else 0, length)
        keys, values = (
            torch.stack(
                [cache[tables[row, p // BLOCK_SIZE], p % BLOCK_SIZE] for p in positions]
            ).float()  # [L, Hkv, D]
            for cache in (key_cache, value_cache)
        )
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", query[row].double(), keys.double()) * SCALE
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values.double())
        # bfloat16 scores and probabilities against float64 ones; float32 sums in another order.
        tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[row].double(), expected, rtol=0, atol=tolerance)
