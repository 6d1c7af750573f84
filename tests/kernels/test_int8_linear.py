"""int8_linear: the reference against an oracle written from the format's definition in
float64, and the Triton kernels (interpreted) against the reference, bit for bit.

Every step of the format is exact or one float32 rounding (the row scale, x / scale, the
integer sum, each scaling), so the oracle, the reference and the Triton path agree to
the bit: float64 holds each float32 operation's exact result (the sum of int8 products
too) and rounds it once to float32 (innocuous double rounding: 53 ≥ 2·24 + 2 bits).
Where torch's int8 GEMM saturates (oneDNN's 16-bit pair sums without VNNI) the reference
sums in float64; that the check finds it, as-is and with oneDNN held to AVX2, is checked
here too.
Under the interpreter the kernels take the CPU launch table (tiles of 16 and 32, K in
steps of 32), so the shapes below reach the small and the large tile, partial row and
column tiles and a K tail. The interpreter casts float32 to bfloat16 by truncation (a GPU
rounds to nearest even), so its bfloat16 outputs are checked to be one or the other.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aioserve.kernels import dispatch
from aioserve.kernels import int8_linear as int8_linear_module
from aioserve.kernels import int8_linear_reference as int8_linear_reference_module
from aioserve.kernels.int8_linear import int8_linear, int8_linear_triton, quantize_rows_int8_triton
from aioserve.kernels.int8_linear_reference import (
    INT8_MAX,
    MIN_SCALE,
    int8_linear_reference,
    integer_products,
    quantize_rows,
    quantize_weight,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# x / scale landing exactly halfway between integers (scale 1, the row's largest being
# 127), and the integers they round to, ties to even; the row again scaled by 2 (scale 2).
_TIES = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 0.25]
_TIES_ROUNDED = [127, 2, 4, -2, -4, 0, 0, 2, -2, 126, -126, 0]


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) * 0.05
    return x, weight


def _tie_rows(k: int) -> torch.Tensor:
    """Two rows of `_TIES` (the second doubled), zero-padded to k columns."""
    rows = torch.zeros(2, k)
    rows[0, : len(_TIES)] = torch.tensor(_TIES)
    rows[1] = rows[0] * 2
    return rows


def _round_half_even(v: torch.Tensor) -> torch.Tensor:
    """float64 `v` rounded to integers, ties to even, without torch.round."""
    r = torch.floor(v + 0.5)
    tie_to_odd = (r - v == 0.5) & (torch.remainder(r, 2) == 1)
    return r - tie_to_odd.double()


def _oracle(
    x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The format's definition in float64, each float32 operation rounded once."""
    x64 = x.double()
    x_scale = (x64.abs().amax(dim=1) / INT8_MAX).float().clamp(min=MIN_SCALE).double()
    scaled = (x64 / x_scale[:, None]).float().double().clamp(-INT8_MAX, INT8_MAX)
    x_q = _round_half_even(scaled)
    sums = x_q @ w_q.double().t()  # exact: |sums| ≤ 127² · K, far below 2⁵³
    out = (sums.float().double() * x_scale[:, None]).float().double()
    out = (out * scale.double().reshape(1, -1)).float()
    if bias is not None:
        out = (out.double() + bias.float().double()).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_against_the_definition(dtype: torch.dtype) -> None:
    x, _ = _inputs(5, 1, 70, 1)
    x[2] = 0  # a row of zeros: the least scale and zero codes
    x[3] *= 1e4
    x = torch.cat([x, _tie_rows(70)]).to(dtype)
    x_q, scale = quantize_rows(x)
    assert x_q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (7,)
    largest = x.float().abs().amax(dim=1)
    assert torch.equal(scale, (largest / 127).clamp(min=MIN_SCALE))
    assert scale[2] == MIN_SCALE and (x_q[2] == 0).all()
    assert torch.equal(x_q.abs().amax(dim=1)[[0, 1, 3, 4]], torch.full((4,), 127, dtype=torch.int8))
    scaled = (x.double() / scale.double()[:, None]).float().double()  # float32's quotient
    assert torch.equal(x_q.double(), _round_half_even(scaled.clamp(-INT8_MAX, INT8_MAX)))
    assert scale[5] == 1 and scale[6] == 2
    for row in (5, 6):
        assert x_q[row, : len(_TIES)].tolist() == _TIES_ROUNDED


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_against_the_oracle(
    dtype: torch.dtype, per_channel: bool, with_bias: bool
) -> None:
    # 1 and 17 rows; K 80 and 70 (neither a multiple of a tile), with a row of zeros and
    # tie rows among the 17.
    for m, n, k in ((1, 40, 80), (17, 24, 70)):
        x, weight = _inputs(m, n, k, 2 + m)
        if m == 17:
            x[4] = 0
            x[10:12] = _tie_rows(k)
        w_q, scale = quantize_weight(weight, per_channel=per_channel)
        assert scale.shape == ((n,) if per_channel else (1,))
        bias = torch.randn(n).to(dtype) if with_bias else None
        out = int8_linear_reference(x.to(dtype), w_q, scale, bias)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(out, _oracle(x.to(dtype), w_q, scale, bias))
        if m == 17:
            assert (out[4] == (0 if bias is None else bias)).all()


def test_the_reference_is_near_the_float_product() -> None:
    x, weight = _inputs(6, 40, 80, 3)
    bias = torch.randn(40)
    w_q, scale = quantize_weight(weight)
    expected = x @ weight.t() + bias
    error = (int8_linear_reference(x, w_q, scale, bias) - expected).norm() / expected.norm()
    assert error < 0.02, error  # int8's 1/254 of each row's range: measured ~0.006


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_row_quantizer_gives_the_reference_bytes(dtype: torch.dtype) -> None:
    # K 70: two steps of 32 and a tail of 6.
    x, _ = _inputs(4, 1, 70, 4)
    x[1] = 0
    x[3] *= 1e4
    x = torch.cat([x, _tie_rows(70)]).to(dtype)
    x_q, scale = quantize_rows_int8_triton(x)
    expected_q, expected_scale = quantize_rows(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(x_q, expected_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_triton_equals_the_reference(rows: int, dtype: torch.dtype) -> None:
    # N 40: a partial column tile; K 80 (two steps of 32 and a tail of 16) and 64 (whole
    # steps: the loop without masks); rows up to 16 take the small tile, more the large.
    for k, per_channel, with_bias in ((80, True, True), (64, False, False)):
        x, weight = _inputs(rows, 40, k, 5 + rows)
        x[0, :4] = torch.tensor([127.0, 2.5, -0.5, 3.5])  # ties in the first row
        w_q, scale = quantize_weight(weight, per_channel=per_channel)
        bias = torch.randn(40).to(dtype) if with_bias else None
        out = int8_linear_triton(x.to(dtype), w_q, scale, bias)
        assert out.dtype == dtype
        assert torch.equal(out, int8_linear_reference(x.to(dtype), w_q, scale, bias))


def test_triton_in_bfloat16_rounds_or_truncates_the_reference() -> None:
    x, weight = _inputs(20, 40, 80, 9)
    x, bias = x.to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    w_q, scale = quantize_weight(weight)
    out = int8_linear_triton(x, w_q, scale, bias)
    exact = int8_linear_reference(x.float(), w_q, scale, bias.float())  # x's values exactly
    rounded = exact.to(torch.bfloat16)
    truncated = (exact.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(rounded, int8_linear_reference(x, w_q, scale, bias))
    assert ((out == rounded) | (out == truncated)).all()


def test_batch_invariant_mode_gives_a_row_the_same_bits_in_any_batch(triton_backend) -> None:
    x, weight = _inputs(40, 40, 64, 7)
    w_q, scale = quantize_weight(weight)
    dispatch.set_batch_invariant(True)
    try:
        alone = [int8_linear(x[i : i + 1], w_q, scale) for i in (0, 17, 39)]
        batched = int8_linear(x, w_q, scale)
    finally:
        dispatch.set_batch_invariant(False)
    assert torch.equal(batched, int8_linear_reference(x, w_q, scale))
    for i, row in zip((0, 17, 39), alone, strict=True):
        assert torch.equal(row[0], batched[i])


def _refuse(*args, **kwargs):
    raise AssertionError("the other path ran")


def test_the_cpu_runs_the_reference(monkeypatch) -> None:
    x, weight = _inputs(3, 24, 64, 6)
    w_q, scale = quantize_weight(weight)
    monkeypatch.setattr(int8_linear_module, "int8_linear_triton", _refuse)
    assert torch.equal(int8_linear(x, w_q, scale), int8_linear_reference(x, w_q, scale))


def test_the_triton_backend_runs_the_kernels(triton_backend, monkeypatch) -> None:
    x, weight = _inputs(3, 24, 64, 6)
    w_q, scale = quantize_weight(weight)
    monkeypatch.setattr(int8_linear_module, "int8_linear_reference", _refuse)
    assert torch.equal(int8_linear(x, w_q, scale), int8_linear_triton(x, w_q, scale))


@pytest.mark.parametrize("product", [int8_linear_reference, int8_linear_triton])
def test_bad_inputs_are_refused(product) -> None:
    x, weight = _inputs(2, 16, 32, 8)
    w_q, scale = quantize_weight(weight)
    with pytest.raises(ValueError, match="int8"):
        product(x, weight, scale)
    with pytest.raises(ValueError, match="int8"):
        product(x, w_q[None], scale)
    with pytest.raises(ValueError, match=r"\[M, 32\]"):
        product(x[:, :16], w_q, scale)
    with pytest.raises(ValueError, match="scale"):
        product(x, w_q, scale[:3])
    with pytest.raises(ValueError, match="scale"):
        product(x, w_q, scale.half())
    with pytest.raises(ValueError, match="bias"):
        product(x, w_q, scale, torch.zeros(15))


def test_triton_refuses_other_dtypes_of_x() -> None:
    x, weight = _inputs(2, 16, 32, 8)
    w_q, scale = quantize_weight(weight)
    with pytest.raises(ValueError, match="x must be one of"):
        int8_linear_triton(x.double(), w_q, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336)])
def test_gpu_triton_equals_reference(triton_backend, device, rows, n, k, dtype) -> None:
    # Llama-3-8B's qkv and down products, through the small and the large tile: the
    # integer sums are exact and the scaling unfused, so the GPU gives the CPU
    # reference's bits (torch's CUDA int8 GEMM wants more than 16 rows: the reference
    # runs on the CPU).
    generator = torch.Generator(device=device).manual_seed(rows + n)
    x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
    weight = torch.randn(n, k, generator=generator, device=device) * 0.05
    w_q, scale = quantize_weight(weight, per_channel=True)
    bias = torch.randn(n, generator=generator, device=device).to(dtype)
    out = int8_linear(x, w_q, scale, bias).cpu()
    assert torch.equal(out, int8_linear_reference(x.cpu(), w_q.cpu(), scale.cpu(), bias.cpu()))


_CHILD_CHECK = """
import torch
from aioserve.kernels.int8_linear_reference import int8_gemm_exact, integer_products
x = torch.full((3, 576), 127, dtype=torch.int8)
w = torch.full((5, 576), -128, dtype=torch.int8)
saturated = torch._int_mm(x, w.t())[0, 0].item() != 127 * -128 * 576
exact = bool((integer_products(x, w) == 127 * -128 * 576).all())
print(int8_gemm_exact(), saturated, exact)
"""


# Whether torch's int8 GEMM saturates is up to torch and oneDNN, not the CPU's flags alone:
# held to AVX2 on a CPU with VNNI, oneDNN's 16-bit pair sums saturate; on a Zen 3 EPYC
# without VNNI torch takes an exact kernel. So the check is held to what the GEMM gives.
@pytest.mark.parametrize("max_isa", [None, "AVX2"], ids=["as-is", "onednn-avx2"])
def test_the_exactness_check_finds_a_saturating_gemm_and_the_sums_stay_exact(max_isa) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if max_isa:
        env["ONEDNN_MAX_CPU_ISA"] = max_isa
    child = subprocess.run(
        [sys.executable, "-c", _CHILD_CHECK], env=env, capture_output=True, text=True, check=True
    )
    exact_check, saturated, sums_exact = child.stdout.split()
    assert exact_check == str(saturated == "False")
    assert sums_exact == "True"


def test_where_the_gemm_is_not_exact_the_sums_are_taken_in_float64(monkeypatch) -> None:
    monkeypatch.setattr(int8_linear_reference_module, "_EXACT", False)
    monkeypatch.setattr(torch, "_int_mm", None)  # never called on this path
    x = torch.full((3, 576), 127, dtype=torch.int8)
    w = torch.full((5, 576), -128, dtype=torch.int8)
    sums = integer_products(x, w)
    assert sums.dtype == torch.int32 and (sums == 127 * -128 * 576).all()
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(-127, 128, (7, 96), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (9, 96), dtype=torch.int8, generator=generator)
    expected = (x.long()[:, None, :] * w.long()[None, :, :]).sum(-1)
    assert torch.equal(integer_products(x, w).long(), expected)
