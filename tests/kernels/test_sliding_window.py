"""The torch path of paged attention through a sliding window, against naive attention.

A row at position p sees keys p - W + 1 .. p. Every path of attention_reference.py is
reached: decodes weighed in the pool (bfloat16 in the CPU's layout) and gathered (other
layouts and float32), in groups of one and of many; prefills through SDPA, and through
the products (bfloat16, 128 rows and more), fresh and over a cached prefix. Slots that
belong to no sequence hold NaN (test_attention.make_batch), so a read the window should
have left out shows up.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import attention_reference, prefill_products
from aioserve.kernels.attention_reference import paged_attention_reference, plan_reference_attention
from tests.kernels.test_attention import LAYOUTS, MIXED, make_batch, naive_attention

_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
WINDOWS = pytest.mark.parametrize("window", [1, 3, 8, 13, 100])


def _check(batch, window: int, dtype: torch.dtype) -> None:
    out = paged_attention_reference(*batch.args(), sliding_window=window)
    assert not out.isnan().any()
    tolerance = _TOLERANCE[dtype]
    expected = naive_attention(batch, window)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@WINDOWS
@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8])
def test_mixed_steps_see_only_their_window(device, window, layout, dtype, block_size):
    batch = make_batch(MIXED, 8, 2, 64, block_size, dtype, device, layout=layout)
    _check(batch, window, dtype)


@WINDOWS
@LAYOUTS
@pytest.mark.parametrize("seqs", [[(1, 37)], [(1, 40), (1, 33), (1, 5)]], ids=["one", "group"])
def test_decode_only_steps_see_only_their_window(device, window, layout, seqs):
    batch = make_batch(seqs, 6, 3, 32, 8, torch.bfloat16, device, layout=layout)
    _check(batch, window, torch.bfloat16)


# 302: the second chunk's first row sees key 255, the last key before a KEY_ALIGN boundary.
@pytest.mark.parametrize("window", [1, 50, 257, 302, 1000])
@LAYOUTS
def test_long_bfloat16_prefills_through_the_products_see_only_their_window(
    device, monkeypatch, window, layout
):
    # The products are forced on a CPU without bfloat16 arithmetic too (host-independent).
    monkeypatch.setattr(prefill_products, "cpu_fast_bf16_flag", lambda: "avx512_bf16")
    products = []
    attend = attention_reference.attend_by_products
    monkeypatch.setattr(
        attention_reference,
        "attend_by_products",
        lambda *args: products.append(args[3]) or attend(*args),
    )
    # A fresh prompt, a chunk of three product chunks over a cached prefix, a decode.
    batch = make_batch([(300, 300), (600, 900), (1, 400)], 6, 2, 64, 16, torch.bfloat16, device)
    _check(batch, window, torch.bfloat16)
    assert len(products) == 2
    # The chunk's blocks wholly before its first row's window are left out; each product
    # chunk then starts reading at its own first row's window, rounded down.
    kept = 300 - max(0, 300 + 1 - window) // 16 * 16  # of the cached prefix
    first_keys = [max(0, kept + start + 1 - window) // 256 * 256 for start in (0, 256, 512)]
    assert [chunk.first_key for chunk in products[1]] == first_keys


def test_a_windowed_plan_leaves_out_the_blocks_before_each_window(device):
    # Lengths 40 and 9 over blocks of 8, a window of 13: the first keeps its last three
    # blocks (positions 24..39, 27..39 seen), the second all of its two.
    batch = make_batch([(1, 40), (1, 9)], 4, 2, 32, 8, torch.float32, device)
    plan = plan_reference_attention(
        batch.query_start_loc.numpy(),
        batch.seq_lens.numpy(),
        batch.block_tables.numpy(),
        8,
        device,
    )
    windowed = plan.for_window(13, 8)
    assert windowed is plan.for_window(13, 8)  # made once a step, kept for every layer
    assert windowed.decodes.lengths.tolist() == [16, 9]
    assert windowed.decodes.tables[0, :2].tolist() == batch.block_tables[0, 3:5].tolist()
    assert windowed.decodes.tables[1, :2].tolist() == batch.block_tables[1, :2].tolist()
    out = paged_attention_reference(*batch.args(), plan=plan, sliding_window=13)
    torch.testing.assert_close(out.double(), naive_attention(batch, 13), atol=1e-5, rtol=1e-5)


@LAYOUTS
def test_a_window_wider_than_every_sequence_changes_nothing(device, layout):
    batch = make_batch(MIXED, 4, 2, 64, 8, torch.bfloat16, device, layout=layout)
    whole = paged_attention_reference(*batch.args())
    assert torch.equal(paged_attention_reference(*batch.args(), sliding_window=41), whole)
