"""The Triton paged-attention kernels through a sliding window, against naive attention.

A row at position p sees keys p - W + 1 .. p only. The interpreter's decode segments hold
32 keys and its prefill tiles 16 rows (attention_launch.py), so the 150-key decode of
WINDOW_SEQS is 5 segments: a window of 3 leaves it one live segment, 45 two (starting
mid-tile, at key 105), 75 three (from key 75); the windows cut the prefill chunks' tiles
mid-way too. The batches are test_attention.make_batch's: shuffled blocks, NaN in every
slot that belongs to no sequence, so a key read outside the sequence shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

from aioserve.kernels import attention_triton
from aioserve.kernels.attention import paged_attention
from aioserve.kernels.kv_cache import quantize_kv
from tests.kernels.test_attention import (
    _TOLERANCE,
    MIXED,
    TRITON_CASES,
    make_batch,
    naive_attention,
)
from tests.kernels.test_fp8_kv_cache import _IDS, FP8

# MIXED's decodes, prompts and chunks over a cached prefix, plus a decode of 5 segments and
# a chunk of 19 tokens after 64 cached (its tiles' windows start at different keys).
WINDOW_SEQS = [*MIXED, (1, 150), (19, 83)]
# TRITON_CASES (GQA 1 to 8, head sizes 64, 80 and 128, blocks of 1 to 32 slots) at a window
# of 45; at 3, inside one block (but for blocks of 1 slot); at 75, over 9 and 2.3 blocks.
WINDOW_CASES = [
    *[(*case, 45) for case in TRITON_CASES],
    *[(*TRITON_CASES[i], 3) for i in (0, 5)],
    *[(*TRITON_CASES[i], 75) for i in (2, 3)],
]


def _windowed(batch, window: int, *args) -> torch.Tensor:
    out = paged_attention(*batch.args(), *args, sliding_window=window)
    assert not out.isnan().any()
    return out


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Every float tensor torch.empty makes starts as +inf, the split decode's workspace
    too: a merge that took a dead segment's max or sums, or a row left unwritten, shows up
    (+inf, not NaN, which a max may skip)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("inf")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize(
    "dtype, num_q_heads, num_kv_heads, head_size, block_size, window", WINDOW_CASES
)
def test_mixed_steps_see_only_their_window(
    triton_backend, device, dtype, num_q_heads, num_kv_heads, head_size, block_size, window
):
    shape = (num_q_heads, num_kv_heads, head_size, block_size)
    batch = make_batch(WINDOW_SEQS, *shape, dtype, device, seed=window)
    out = _windowed(batch, window)
    torch.testing.assert_close(out.double(), naive_attention(batch, window), **_TOLERANCE[dtype])


def test_a_window_of_one_is_each_rows_own_value(triton_backend, device):
    batch = make_batch(WINDOW_SEQS, 4, 2, 64, 8, torch.float16, device)
    out = _windowed(batch, 1)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        query_len = starts[b + 1] - starts[b]
        own = batch.values[b][seq_len - query_len :].repeat_interleave(2, dim=1)
        assert torch.equal(out[starts[b] : starts[b + 1]], own)


@pytest.mark.parametrize(
    "dtype, num_q_heads, num_kv_heads, head_size, block_size",
    [TRITON_CASES[i] for i in (1, 2, 5)],
)
def test_a_window_over_the_whole_context_is_full_attention_bitwise(
    triton_backend, device, dtype, num_q_heads, num_kv_heads, head_size, block_size
):
    # 150 keys: the longest sequence's context exactly, the others' and more.
    shape = (num_q_heads, num_kv_heads, head_size, block_size)
    batch = make_batch(WINDOW_SEQS, *shape, dtype, device)
    assert torch.equal(_windowed(batch, 150), paged_attention(*batch.args()))


@pytest.mark.parametrize("window", [1, 32, 45, 75, 130])
def test_windowed_decodes_merge_only_their_live_segments(
    triton_backend, device, poisoned_workspace, window
):
    # Windows that start on a segment boundary (64 - 32, 97 - 1) and inside one, from 0 to 6
    # segments dead before them and 1 to 5 live.
    seqs = [(1, 150), (1, 64), (1, 33), (1, 97), (1, 200), (1, 5)]
    batch = make_batch(seqs, 4, 2, 64, 16, torch.float32, device, seed=window)
    out = _windowed(batch, window)
    expected = naive_attention(batch, window)
    torch.testing.assert_close(out.double(), expected, **_TOLERANCE[torch.float32])


# The tiles' padding rows, past the prompt, may see no key at all: 0/0, never stored.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_prefill_rows_that_see_no_key_of_a_tile_stay_finite(triton_backend, device, monkeypatch):
    # A GPU's prefill tiles hold more tokens than its key tiles (64 and 32 on CUDA): a row
    # BLOCK_N or more tokens past the tile's first sees no key of the tile's first key tile.
    # The interpreter's tiles are 16 and 16; here 64 rows, GQA 1.
    config = attention_triton.launch_config

    def wide_tiles(*args):
        return config(*args) | {"block_m": 64}

    monkeypatch.setattr(attention_triton, "launch_config", wide_tiles)
    batch = make_batch([(70, 70), (1, 40), (50, 90)], 2, 2, 64, 16, torch.float32, device)
    for window in (5, 20):
        out = _windowed(batch, window)
        expected = naive_attention(batch, window)
        torch.testing.assert_close(out.double(), expected, **_TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "fp8, dtype",
    [(FP8[0], torch.float16), (FP8[1], torch.float32), (FP8[2], torch.float16)],
    ids=_IDS,
)
def test_a_windowed_fp8_cache_reads_its_values_times_the_scales(triton_backend, device, fp8, dtype):
    # Against naive attention over the values the fp8 cache holds (the scales are powers of
    # two: dequantizing rounds nothing).
    batch = make_batch(WINDOW_SEQS, 4, 1, 64, 16, dtype, device, seed=5)
    k_scale, v_scale = torch.tensor([1 / 32], device=device), torch.tensor([1 / 8], device=device)
    key_cache = quantize_kv(batch.key_cache, k_scale, fp8)
    value_cache = quantize_kv(batch.value_cache, v_scale, fp8)
    batch.keys = [quantize_kv(k, k_scale, fp8).float() * k_scale for k in batch.keys]
    batch.values = [quantize_kv(v, v_scale, fp8).float() * v_scale for v in batch.values]
    batch.key_cache, batch.value_cache = key_cache, value_cache
    out = _windowed(batch, 45, None, None, k_scale, v_scale)
    torch.testing.assert_close(out.double(), naive_attention(batch, 45), **_TOLERANCE[dtype])


def test_windowed_decode_and_chunk_are_the_same_alone_and_at_batch_64(triton_backend, device):
    # A decode over 5 segments and a chunk of 20 tokens after 70, alone and among 64 other
    # sequences (decodes and prefills of other lengths): other offsets, other physical
    # blocks, another max_query_len and max_seq_len; bit for bit.
    window = 45
    args = (2, 1, 32, 16, torch.float16, device)
    singles = [make_batch([(1, 150)], *args, seed=30), make_batch([(20, 90)], *args, seed=31)]
    alone = [_windowed(single, window) for single in singles]
    seqs = [(1, 1 + (37 * i) % 200) if i % 8 else (3 + i % 5, 40 + i) for i in range(66)]
    seqs[17], seqs[50] = (1, 150), (20, 90)
    batch = make_batch(seqs, *args, seed=32)
    starts = batch.query_start_loc.tolist()
    for index, single in zip((17, 50), singles, strict=True):
        batch.query[starts[index] : starts[index + 1]] = single.query
        for i in range(math.ceil(int(single.seq_lens[0]) / 16)):
            dst, src = int(batch.block_tables[index, i]), int(single.block_tables[0, i])
            batch.key_cache[dst] = single.key_cache[src]
            batch.value_cache[dst] = single.value_cache[src]
    together = _windowed(batch, window)
    for index, a in zip((17, 50), alone, strict=True):
        assert torch.equal(together[starts[index] : starts[index + 1]], a)
