"""Prefill attention as batched products (kernels/prefill_products.py): which prefills take
them, the padded chunks they run in, and their output against a naive float64 attention
over the same paged caches (NaN in every free slot, each pool layout)."""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import attention_reference, prefill_products
from aioserve.kernels.attention_reference import paged_attention_reference
from aioserve.kernels.prefill_products import (
    CHUNK_ROWS,
    KEY_ALIGN,
    MAX_KEYS,
    MIN_ROWS,
    ROW_ALIGN,
    plan_chunks,
    uses_products,
)
from tests.kernels.test_attention import LAYOUTS, make_batch, naive_attention


@LAYOUTS
def test_long_bfloat16_prefills_take_the_products_and_match_naive(device, monkeypatch, layout):
    # Two chunks of a fresh prompt (the second padded), a chunk over a cached prefix, a
    # short prefill (SDPA) and a decode, in one step. The products are forced on a CPU
    # without bfloat16 arithmetic too: their result does not depend on the host.
    monkeypatch.setattr(prefill_products, "cpu_fast_bf16_flag", lambda: "avx512_bf16")
    seqs = [(CHUNK_ROWS + 44, CHUNK_ROWS + 44), (150, 420), (20, 20), (1, 40)]
    batch = make_batch(seqs, 9, 3, 64, 16, torch.bfloat16, device, layout=layout)
    taken = []
    products = attention_reference.attend_by_products

    def recording_products(query, keys, values, chunks, scale, out):
        taken.append((query.shape[0], [(c.padded_rows, c.keys) for c in chunks]))
        products(query, keys, values, chunks, scale, out)

    monkeypatch.setattr(attention_reference, "attend_by_products", recording_products)
    out = paged_attention_reference(*batch.args())
    assert taken == [(CHUNK_ROWS + 44, [(256, 256), (64, 512)]), (150, [(192, 512)])]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-2, rtol=2e-2)


def test_chunks_attend_causally_over_the_prefix_in_padded_shapes():
    query_len, seq_len, group = 700, 900, 3
    chunks = plan_chunks(query_len, seq_len, group, torch.device("cpu"))
    assert [(c.start, c.end) for c in chunks] == [(0, 256), (256, 512), (512, 700)]
    assert [(c.padded_rows, c.keys) for c in chunks] == [(256, 512), (256, 768), (192, 1024)]
    context = seq_len - query_len
    for chunk in chunks:
        assert chunk.padded_rows % ROW_ALIGN == 0 and chunk.keys % KEY_ALIGN == 0
        assert chunk.bias.shape == (group * chunk.padded_rows, chunk.keys)
        heads = chunk.bias.view(group, chunk.padded_rows, chunk.keys)
        assert (heads == heads[:1]).all()  # the same mask for every head of the group
        attended = heads[0] == 0
        rows = chunk.end - chunk.start
        positions = context + chunk.start + torch.arange(rows)
        keys = torch.arange(chunk.keys)
        expected = (keys[None, :] <= positions[:, None]) & (keys[None, :] < seq_len)
        assert torch.equal(attended[:rows], expected)
        assert attended[rows:].any(1).all()  # a padded row is never empty (no NaN)


def test_products_only_for_long_enough_bfloat16_prefills_within_the_key_cap(monkeypatch):
    monkeypatch.setattr(prefill_products, "cpu_fast_bf16_flag", lambda: "avx512_bf16")
    assert uses_products(torch.bfloat16, MIN_ROWS, MIN_ROWS)
    assert not uses_products(torch.bfloat16, MIN_ROWS - 1, 2000)
    assert not uses_products(torch.float32, 1000, 1000)
    assert uses_products(torch.bfloat16, MIN_ROWS, MAX_KEYS)
    assert not uses_products(torch.bfloat16, MIN_ROWS, MAX_KEYS + 1)


@pytest.mark.parametrize("flag", [None, "amx_bf16"])
def test_no_products_without_bfloat16_arithmetic_nor_with_amx(monkeypatch, flag):
    # With AMX, torch's flash kernel (SDPA) multiplies its blocks on the tiles and is faster.
    monkeypatch.setattr(prefill_products, "cpu_fast_bf16_flag", lambda: flag)
    assert not uses_products(torch.bfloat16, 1000, 1000)
