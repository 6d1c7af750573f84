"""AWQ / GPTQ 4-bit weights: the unpacking against the formats' published packing, the
kernels' layout made from it, and the Triton kernels (interpreted) against the reference.

- Words written by hand from the formats' statements (AWQ's interleaved order 0, 2, 4, 6,
  1, 3, 5, 7; GPTQ's values along K, zero points stored as z - 1 in v1) and random codes
  packed by the numpy packers of tests/models/tiny_quantized.py unpack exactly to their
  codes and zero points.
- `kernel_layout` (act-order sorted by group) dequantizes to exactly the weight the
  unpacked codes give, and refuses what the kernels cannot take; stacked shards are
  stacked only when they read x in one order.
- The Triton GEMV, small- and large-tile GEMMs, with and without act-order, split K or not,
  with a bias, in float16 and float32 (the interpreter multiplies bfloat16 wrongly), equal
  the float32 reference to float32's rounding, or within float16's output rounding.
- On a GPU (pytest -m gpu), compiled, in bfloat16 too, at SmolLM2's and Llama-3-8B's shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.kernels import dispatch
from aioserve.kernels.int4_group_linear import int4_group_linear, int4_group_linear_triton
from aioserve.kernels.int4_group_linear_reference import (
    GroupedCodes,
    concat_layouts,
    dequantize,
    dequantize_layout,
    int4_group_linear_reference,
    kernel_layout,
    unpack_awq,
    unpack_gptq,
)
from tests.models.tiny_quantized import pack_awq, pack_gptq_columns, pack_gptq_rows


def _word(value: int) -> torch.Tensor:
    """An int32 holding the unsigned 32 bits `value`."""
    return torch.tensor([[np.uint32(value).view(np.int32)]], dtype=torch.int32)


def test_awq_words_by_hand():
    # outputs 0..7 hold 1..8; value i of the word is output AWQ_ORDER[i]: 1, 3, 5, 7, 2, 4, 6, 8
    word = _word(0x86427531)
    zeros = _word(0x00000F00)  # value 2 -> output 4 holds zero point 15
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    grouped = unpack_awq(word.repeat(32, 1), zeros, scales, group_size=32)
    assert grouped.codes[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert grouped.zeros[0].tolist() == [0, 0, 0, 0, 15, 0, 0, 0]
    weight = dequantize(grouped)  # [N, K]
    assert weight[:, 0].tolist() == [0.5, 1.0, 1.5, 2.0, -5.0, 3.0, 3.5, 4.0]


def test_gptq_words_by_hand():
    qweight = _word(0x87654321).repeat(1, 8)  # inputs 0..7 hold 1..8, every output
    qzeros = _word(0x000000F7)  # output 0 stores 7, output 1 stores 15, the rest 0
    scales = torch.full((1, 8), 2.0, dtype=torch.float16)
    v1 = unpack_gptq(qweight, qzeros, scales, None, group_size=-1)
    assert v1.codes[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert v1.zeros[0].tolist() == [8, 16, 1, 1, 1, 1, 1, 1]  # stored z - 1
    assert dequantize(v1)[0].tolist() == [2.0 * (q - 8) for q in range(1, 9)]
    v2 = unpack_gptq(qweight, qzeros, scales, None, group_size=-1, v2=True)
    assert v2.zeros[0].tolist() == [7, 15, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_unpacking_inverts_the_published_packing(method):
    rng = np.random.default_rng(0)
    k, n, group = 64, 24, 16
    codes = rng.integers(0, 16, (k, n))
    zeros = rng.integers(0, 16, (k // group, n))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float16))
    if method == "awq":
        qweight, qzeros = torch.from_numpy(pack_awq(codes)), torch.from_numpy(pack_awq(zeros))
        grouped = unpack_awq(qweight, qzeros, scales, group)
        expected_zeros = zeros
    else:
        qweight = torch.from_numpy(pack_gptq_rows(codes))
        qzeros = torch.from_numpy(pack_gptq_columns(zeros))
        g_idx = torch.from_numpy(rng.permutation(np.arange(k) // group).astype(np.int32))
        grouped = unpack_gptq(qweight, qzeros, scales, g_idx, group)
        expected_zeros = zeros + 1
        assert torch.equal(grouped.g_idx, g_idx.long())
    assert grouped.codes.dtype == torch.uint8
    assert np.array_equal(grouped.codes.numpy(), codes)
    assert np.array_equal(grouped.zeros.numpy(), expected_zeros)
    assert torch.equal(grouped.scales, scales)


def _grouped(k: int, n: int, group: int, act_order: bool, seed: int = 0) -> GroupedCodes:
    generator = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    codes = torch.randint(0, 16, (k, n), generator=generator).to(torch.uint8)
    zeros = torch.randint(0, 17, (k // size, n), generator=generator).to(torch.uint8)
    scales = (torch.rand(k // size, n, generator=generator) * 0.05 + 0.005).half()
    return GroupedCodes(codes, zeros, scales, g_idx)


@pytest.mark.parametrize(("group", "act_order"), [(32, False), (32, True), (-1, False)])
def test_the_kernel_layout_holds_the_same_weight(group, act_order):
    grouped = _grouped(128, 16, group, act_order)
    layout = kernel_layout(grouped, group)
    assert layout.qweight.shape == (16, 16) and layout.qweight.dtype == torch.int32
    assert (layout.perm is not None) == act_order
    if act_order:  # positions sorted by group
        assert torch.equal(grouped.g_idx[layout.perm.long()], torch.arange(128) // 32)
    weight = dequantize_layout(
        layout.qweight, layout.scales, layout.zeros, layout.perm, layout.group_size
    )
    assert torch.equal(weight, dequantize(grouped))


def test_the_kernel_layout_refuses_what_the_kernels_cannot_take():
    grouped = _grouped(96, 8, 32, act_order=False)
    with pytest.raises(ValueError, match="multiple of 16 dividing the inputs"):
        kernel_layout(grouped, 24)
    uneven = GroupedCodes(grouped.codes, grouped.zeros, grouped.scales, torch.arange(96) % 3 // 2)
    with pytest.raises(ValueError, match="groups of equal size"):
        kernel_layout(uneven, 32)


def test_stacked_shards_share_one_input_order_or_are_not_stacked():
    first, second = _grouped(64, 16, 32, True, seed=1), _grouped(64, 8, 32, True, seed=2)
    q, k = kernel_layout(first, 32), kernel_layout(second, 32)
    assert concat_layouts([q, k]) is None  # two act-order permutations: x has one order
    same_order = GroupedCodes(second.codes, second.zeros, second.scales, first.g_idx)
    same = kernel_layout(same_order, 32)
    stacked = concat_layouts([q, same])
    assert stacked is not None and torch.equal(stacked.perm, q.perm)
    assert torch.equal(stacked.qweight, torch.cat([q.qweight, same.qweight], dim=1))


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


# rows: the GEMV (up to 4 rows in the interpreter's table), the small tile (16) and the
# large one; N = 40 and K = 256 make partial column tiles and splits of K.
@pytest.mark.parametrize(
    ("rows", "group", "act_order", "dtype"),
    [
        (1, 32, False, torch.float32),
        (3, 64, True, torch.float16),
        (9, 32, True, torch.float32),
        (20, -1, False, torch.float16),
        (40, 128, True, torch.float32),
    ],
)
def test_the_triton_kernels_match_the_reference(rows, group, act_order, dtype):
    k, n = 256, 40
    layout = kernel_layout(_grouped(k, n, group, act_order, seed=rows), group)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    args = (layout.qweight, layout.scales, layout.zeros, layout.perm, layout.group_size, bias)
    got = int4_group_linear_triton(x, *args)
    expected = int4_group_linear_reference(x.float(), *args)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert _relative_error(got, expected) < (2e-6 if dtype == torch.float32 else 1e-3)


def test_batch_invariant_mode_and_the_dispatch(triton_backend):
    layout = kernel_layout(_grouped(128, 24, 32, act_order=True), 32)
    args = (layout.qweight, layout.scales, layout.zeros, layout.perm, layout.group_size)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    expected = int4_group_linear_reference(x, *args)
    dispatch.set_batch_invariant(True)
    try:
        got = int4_group_linear(x, *args)  # the Triton path: triton_backend
    finally:
        dispatch.set_batch_invariant(False)
    assert _relative_error(got, expected) < 2e-6


def test_malformed_operands_are_refused():
    layout = kernel_layout(_grouped(64, 16, 32, act_order=False), 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="qweight for K = 32"):
        int4_group_linear_triton(x[:, :32], layout.qweight, layout.scales, layout.zeros, None, 32)
    with pytest.raises(ValueError, match="group size 24"):
        int4_group_linear_triton(x, layout.qweight, layout.scales, layout.zeros, None, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(
    ("n", "k", "group", "act_order"), [(960, 576, 64, False), (6144, 4096, 128, True)]
)
def test_gpu_triton_matches_reference(device, dtype, rows, n, k, group, act_order):
    layout = kernel_layout(_grouped(k, n, group, act_order), group)
    args = [
        t.to(device) if t is not None else None
        for t in (layout.qweight, layout.scales, layout.zeros, layout.perm)
    ]
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    bias = torch.randn(n, generator=generator).to(device, dtype)
    got = int4_group_linear_triton(x, *args, group, bias)
    expected = int4_group_linear_reference(x, *args, group, bias)
    # relative to the whole output, as bench/kernel_cases.py compares (bf16 keeps 8 bits)
    tolerance = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]
    assert _relative_error(got, expected) < tolerance
