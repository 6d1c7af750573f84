"""decode_in_pool: which pool rows the bags read, how a step's decodes are grouped, and
which pools qualify. Its attention against naive attention is in test_attention.py (the
"cpu" layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.kernels import decode_in_pool, kv_cache
from aioserve.kernels.attention_reference import paged_attention_reference
from aioserve.kernels.decode_groups import padded_positions
from aioserve.kernels.decode_in_pool import (
    MAX_PADDING_SLOTS,
    group_decodes,
    key_rows,
    reads_in_place,
    stored_rows,
    value_rows,
)
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, NUM_Q_HEADS = 9, 4, 2, 8, 6


def _numbered_pool(layout: str) -> torch.Tensor:
    """A cache whose every element holds its own logical index, as a float."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    cache = empty_kv_cache(*shape, torch.float32, torch.device("cpu"), layout)
    return cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(shape))


def test_key_rows_hold_each_blocks_slots_of_one_component():
    cache = _numbered_pool("dim_major")
    blocks = np.array([[3, 0, 7], [5, 5, 5]])
    at = torch.from_numpy(key_rows(blocks, cache, NUM_Q_HEADS)).long()
    rows = stored_rows(cache, BLOCK_SIZE)[at]
    rows = rows.view(2, NUM_Q_HEADS, 3, HEAD_SIZE, BLOCK_SIZE)
    for seq in range(2):
        for head in range(NUM_Q_HEADS):
            kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
            for j, block in enumerate(blocks[seq].tolist()):
                # [D, block_size]: the block's keys of that kv head, transposed.
                expected = cache[block, :, kv_head, :].T
                assert torch.equal(rows[seq, head, j], expected)


@pytest.mark.parametrize("layout", ["head_major", "slot_major"])
def test_value_rows_hold_each_slots_value_and_padding_reads_the_first(layout):
    cache = _numbered_pool(layout)
    blocks = np.array([[3, 0, 7], [5, 2, 2]])
    lengths = np.array([11, 5])
    width = 11  # the longest: its third block's last slot is not read
    at = torch.from_numpy(value_rows(blocks, lengths, width, cache, NUM_Q_HEADS)).long()
    rows = stored_rows(cache, HEAD_SIZE)[at].view(2, NUM_Q_HEADS, width, HEAD_SIZE)
    for seq in range(2):
        for head in range(NUM_Q_HEADS):
            kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
            for slot in range(width):
                if slot >= lengths[seq]:
                    block, offset = int(blocks[seq, 0]), 0
                else:
                    block, offset = int(blocks[seq, slot // BLOCK_SIZE]), slot % BLOCK_SIZE
                assert torch.equal(rows[seq, head, slot], cache[block, offset, kv_head])


def test_decodes_are_grouped_by_length_with_padding_bounded():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40 * 16, size=200)
    groups = group_decodes(lengths, 16, 9, 64)
    assert sorted(np.concatenate(groups).tolist()) == list(range(200))
    blocks = -(-lengths // 16)
    previous_widest = 0
    for group in groups:
        widths = blocks[group]
        assert (np.diff(widths) >= 0).all()  # sorted by length
        assert widths.min() >= previous_widest
        previous_widest = widths.max()
        # Growing to its widest member padded the sequences before it by at most the bound
        # at every step.
        for i in range(1, len(group)):
            assert i * (widths[i] - widths[i - 1]) * 16 <= MAX_PADDING_SLOTS
    # One long sequence among short ones gets a group of its own.
    alone = group_decodes(np.array([20] * 40 + [2000]), 16, 9, 64)
    assert [len(g) for g in alone] == [40, 1]


def test_decodes_that_fit_one_group_keep_the_step_order():
    # Sorted they would be [1, 3, 2, 0]; one group keeps its query rows one slice.
    assert [g.tolist() for g in group_decodes(np.array([70, 20, 45, 33]), 16, 9, 64)] == [
        [0, 1, 2, 3]
    ]


@pytest.mark.parametrize("on_host", [True, False], ids=["host-array", "tensor"])
def test_padded_positions_are_each_query_heads_padded_slots(on_host):
    pairs = [[0, 5], [1, 3], [1, 7]]  # (sequence, slot)
    padding = np.array(pairs) if on_host else torch.tensor(pairs)
    positions = padded_positions(padding, NUM_Q_HEADS, 8)
    scores = torch.zeros(2, NUM_Q_HEADS, 8)
    scores.view(-1)[torch.as_tensor(positions)] = 1
    expected = torch.zeros(2, NUM_Q_HEADS, 8)
    expected[0, :, 5] = expected[1, :, 3] = expected[1, :, 7] = 1
    assert torch.equal(scores, expected)


def test_groups_stay_under_the_bag_row_bound(monkeypatch):
    monkeypatch.setattr(decode_in_pool, "MAX_BAG_ROWS", 10_000)
    lengths = np.full(50, 64)  # 4 blocks of 16: 9 * 4 * (64 + 16) = 2,880 rows a sequence
    groups = group_decodes(lengths, 16, 9, 64)
    assert [len(g) for g in groups] == [3] * 16 + [2]


@pytest.mark.parametrize("avx512", [False, True], ids=["avx2", "avx512"])
def test_only_the_cpu_layouts_in_the_compute_dtype_are_read_in_place(monkeypatch, avx512):
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: avx512)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)

    def pool(layout, dtype=torch.bfloat16):
        return empty_kv_cache(*shape, dtype, torch.device("cpu"), layout)

    keys, values = torch_path_layouts(torch.bfloat16)
    assert reads_in_place(pool(keys), pool(values), torch.bfloat16)
    # float32 is read in place on a CPU without AVX-512 and gathers on one with it (see the
    # module): its pool is then head-major, and even dim-major keys are not read in place.
    float32 = pool(keys, torch.float32), pool(values, torch.float32)
    if avx512:
        assert torch_path_layouts(torch.float32) == ("head_major", "head_major")
        assert not reads_in_place(*float32, torch.float32)
    else:
        assert torch_path_layouts(torch.float32) == (keys, values)
        assert reads_in_place(*float32, torch.float32)
    assert reads_in_place(pool(keys), pool("slot_major"), torch.bfloat16)
    assert not reads_in_place(pool("head_major"), pool(values), torch.bfloat16)
    assert not reads_in_place(pool(keys), pool(keys), torch.bfloat16)  # values not in runs
    assert not reads_in_place(pool(keys), pool(values), torch.float32)  # not the dtype
    half = (pool(keys, torch.float16), pool(values, torch.float16))
    assert not reads_in_place(*half, torch.float16)
    # A view that skips blocks is not dense: its rows are not the pool's rows.
    assert not reads_in_place(pool(keys)[::2], pool(values)[::2], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_weighed_in_the_pool_gets_the_same_bits_beside_a_longer_one(monkeypatch, dtype):
    # Its softmax runs over whole blocks, whatever the group's longest: a sequence's
    # attention alone is bit for bit its attention in one group with a longer one, whose
    # blocks its scores are padded to (and its value bags to the longer length). Five
    # slots: torch's softmax takes another way through a row shorter than a vector.
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: False)  # float32 read in place
    block_size, num_blocks, lengths = 16, 16, [5, 150]
    keys, values = torch_path_layouts(dtype)
    generator = torch.Generator().manual_seed(3)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE)
    pools = [
        empty_kv_cache(*shape, dtype, torch.device("cpu"), layout).copy_(
            torch.randn(shape, generator=generator)
        )
        for layout in (keys, values)
    ]
    assert reads_in_place(*pools, dtype)
    tables = torch.tensor([[3] + [0] * 9, [5, 1, 2, 8, 9, 10, 11, 12, 13, 14]])
    query = torch.randn(2, NUM_Q_HEADS, HEAD_SIZE, generator=generator).to(dtype)

    def attend(rows: list[int]) -> torch.Tensor:
        seq_lens = torch.tensor([lengths[r] for r in rows])
        return paged_attention_reference(
            query[rows],
            *pools,
            torch.arange(len(rows) + 1),
            seq_lens,
            tables[rows],
            HEAD_SIZE**-0.5,
            1,
            int(seq_lens.max()),
        )

    assert len(group_decodes(np.array(lengths), block_size, NUM_Q_HEADS, HEAD_SIZE)) == 1
    alone, beside, after = attend([0]), attend([0, 1]), attend([1, 0])
    assert torch.isfinite(alone).all()
    assert torch.equal(beside[0], alone[0]) and torch.equal(after[1], alone[0])
    assert torch.equal(beside[1], after[0])
