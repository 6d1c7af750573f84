"""fp8_block_linear: the reference's quantizers against the format's definition written out
block by block (tests/models/tiny_fp8_block.py's and a loop here), the reference against
the sum of its groups' scaled products, and the Triton kernels (interpreted) against the
reference.

The Triton group quantizer must give the reference's bytes exactly (both divide in float32
and round to nearest, ties to even); the product then differs only in the order of exact
float32 sums. Under the interpreter the kernels take the CPU launch table (tiles of 16 and
32 rows, K in steps of 32, cut to the group where it is narrower), so the shapes below
reach the small and the large tile, partial row and column tiles, a K tail inside the last
group, and groups of several steps.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import dispatch
from aioserve.kernels.fp8_block_linear import (
    fp8_block_linear,
    fp8_block_linear_triton,
    quantize_groups_triton,
)
from aioserve.kernels.fp8_block_linear_reference import (
    dequantize_blocks,
    fp8_block_linear_reference,
    quantize_groups,
    quantize_weight_blocks,
)
from aioserve.kernels.fp8_linear_reference import FP8_MAX, to_e4m3fnuz
from tests.models.tiny_fp8_block import quantize_blocks

E4M3 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
# Triton against the reference: the same exact products, summed in another order;
# float16 output adds its rounding (outputs ~10 here, one float16 step 8e-3).
_TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-2, rtol=2e-3)}


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * torch.linspace(0.1, 10, k)  # groups differ
    weight = torch.randn(n, k, generator=generator) * 0.05
    return x, weight


def _loop_groups(x: torch.Tensor, group: int, fp8_dtype: torch.dtype):
    """quantize_groups' definition, a row and group at a time."""
    x_q = torch.empty(x.shape, dtype=fp8_dtype)
    scales = torch.empty(x.shape[0], -(-x.shape[1] // group))
    for m in range(x.shape[0]):
        for g, start in enumerate(range(0, x.shape[1], group)):
            part = x[m, start : start + group]
            scales[m, g] = max(part.abs().max().item() / FP8_MAX[fp8_dtype], 1 / (448 * 512))
            x_q[m, start : start + group] = (part / scales[m, g]).to(fp8_dtype)
    return x_q, scales


@pytest.mark.parametrize("fp8_dtype", E4M3)
@pytest.mark.parametrize(("k", "group"), [(256, 128), (80, 32), (100, 64)])
def test_quantize_groups_is_the_format_a_group_at_a_time(fp8_dtype, k, group) -> None:
    x, _ = _inputs(3, 1, k, 1)
    x[1, :group] = 0  # a group of zeros: the least scale, not 0/0
    x_q, scales = quantize_groups(x, group, fp8_dtype)
    expected_q, expected_scales = _loop_groups(x, group, fp8_dtype)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("block", [(128, 128), (48, 64), (1, 32)])
def test_quantize_weight_blocks_is_a_block_at_a_time(block) -> None:
    _, weight = _inputs(1, 130, 200, 2)
    values, scales = quantize_weight_blocks(weight, block, torch.float8_e4m3fn)
    expected_values, expected_scales = quantize_blocks(weight, block)
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    error = (dequantize_blocks(values, scales, block) - weight).norm() / weight.norm()
    assert error < 2**-5


def test_the_reference_sums_its_groups_scaled_products() -> None:
    """y = Σ_g s_x[:, g] · s_w[n // rows, g] · (x_q W_qᵀ over group g), written out."""
    block = (48, 64)
    x, weight = _inputs(5, 100, 200, 3)
    w_q, w_scale = quantize_weight_blocks(weight, block, torch.float8_e4m3fn)
    bias = torch.randn(100)
    x_q, x_scale = quantize_groups(x, block[1], torch.float8_e4m3fn)
    expected = bias.double().expand(5, 100).clone()
    for g, start in enumerate(range(0, 200, block[1])):
        columns = slice(start, start + block[1])
        part = x_q[:, columns].double() @ w_q[:, columns].double().t()
        row_scales = w_scale[:, g].double().repeat_interleave(block[0])[:100]
        expected += part * x_scale[:, g, None].double() * row_scales[None, :]
    out = fp8_block_linear_reference(x, w_q, w_scale, block, bias)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and near the float product: e4m3's rounding of x and W (each up to 2⁻⁴ relative,
    # ~2⁻⁶ on average), nothing else; measured 0.035 of the output's norm here.
    exact = x @ weight.t() + bias
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("fp8_dtype", E4M3)
@pytest.mark.parametrize(("rows", "k", "group"), [(1, 256, 128), (3, 100, 64), (5, 2200, 16)])
def test_triton_group_quantizer_gives_the_reference_bytes(fp8_dtype, rows, k, group) -> None:
    # 2,200 columns in groups of 16: 138 groups, more than a program's 2 on the CPU's table
    x, _ = _inputs(rows, 1, k, 4)
    x_q, scales = quantize_groups_triton(x, group, fp8_dtype)
    expected_q, expected_scales = quantize_groups(x, group, fp8_dtype)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(x_q.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 20, 40])
def test_triton_against_the_reference(rows: int, dtype: torch.dtype) -> None:
    # N = 40: a partial column tile. K = 80 in groups of 64 (two steps of 32, then a group
    # of 16 columns: a K tail); K = 96 in groups of 16 (steps cut to 16) with a scale row a
    # weight row (a stacked layer's spread scales); K = 128 in one group of 128 (four steps).
    bias = torch.randn(40)
    for k, block, fp8_dtype, with_bias in (
        (80, (48, 64), torch.float8_e4m3fn, True),
        (96, (1, 16), torch.float8_e4m3fnuz, False),
        (128, (32, 128), torch.float8_e4m3fn, False),
    ):
        x, weight = _inputs(rows, 40, k, 5 + rows + k)
        w_q, scale = quantize_weight_blocks(weight, block, torch.float8_e4m3fn)
        if fp8_dtype == torch.float8_e4m3fnuz:
            w_q, scale = to_e4m3fnuz(w_q, scale)
        b = bias.to(dtype) if with_bias else None
        out = fp8_block_linear_triton(x.to(dtype), w_q, scale, block, b)
        expected = fp8_block_linear_reference(x.to(dtype), w_q, scale, block, b)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **_TOLERANCE[dtype])


def test_the_cpu_runs_the_reference() -> None:
    x, weight = _inputs(3, 24, 64, 6)
    w_q, scale = quantize_weight_blocks(weight, (16, 32), torch.float8_e4m3fn)
    assert torch.equal(
        fp8_block_linear(x, w_q, scale, (16, 32)),
        fp8_block_linear_reference(x, w_q, scale, (16, 32)),
    )


def test_batch_invariant_mode_gives_a_row_the_same_bits_in_any_batch(triton_backend) -> None:
    x, weight = _inputs(40, 40, 64, 7)
    w_q, scale = quantize_weight_blocks(weight, (32, 32), torch.float8_e4m3fn)
    dispatch.set_batch_invariant(True)
    try:
        alone = [fp8_block_linear(x[i : i + 1], w_q, scale, (32, 32)) for i in (0, 17, 39)]
        batched = fp8_block_linear(x, w_q, scale, (32, 32))
    finally:
        dispatch.set_batch_invariant(False)
    for i, row in zip((0, 17, 39), alone, strict=True):
        assert torch.equal(row[0], batched[i])


def test_bad_inputs_are_refused() -> None:
    x, weight = _inputs(2, 16, 64, 8)
    w_q, scale = quantize_weight_blocks(weight, (16, 32), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_block_linear_reference(x, weight, scale, (16, 32))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        fp8_block_linear_reference(x[:, :32], w_q, scale, (16, 32))
    with pytest.raises(ValueError, match=r"block scales must be float32 \[1, 4\]"):
        fp8_block_linear_reference(x, w_q, scale, (16, 16))
    with pytest.raises(ValueError, match="power of two of at least 16"):
        fp8_block_linear_triton(x, w_q, scale.repeat_interleave(2, 1)[:, :3], (16, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336)])
def test_gpu_triton_matches_reference(triton_backend, device, rows, n, k, dtype) -> None:
    # Llama-3-8B's qkv and down products in 128 x 128 blocks, through both tiles.
    generator = torch.Generator(device=device).manual_seed(rows + n)
    x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
    weight = torch.randn(n, k, generator=generator, device=device) * 0.05
    w_q, scale = quantize_weight_blocks(weight, (128, 128), torch.float8_e4m3fn)
    out = fp8_block_linear(x, w_q, scale, (128, 128)).double()
    expected = fp8_block_linear_reference(x, w_q, scale, (128, 128)).double()
    error = ((out - expected).norm() / expected.norm()).item()
    assert error <= {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 3e-4}[dtype]
