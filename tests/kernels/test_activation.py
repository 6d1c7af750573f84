"""silu_and_mul and gelu_tanh_and_mul: the torch references against the formula in float64
(GELU's against torch's F.gelu(approximate="tanh"), transformers' `gelu_pytorch_tanh`), the
Triton kernels against the references."""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)

_TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_formula(device, dtype):
    x = (torch.randn(6, 2 * 50, device=device) * 4).to(dtype)
    gate, up = x.double()[:, :50], x.double()[:, 50:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = silu_and_mul_reference(x)
    assert out.shape == (6, 50) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **_TOLERANCE[dtype])


@pytest.mark.parametrize("activation", [silu_and_mul, gelu_tanh_and_mul])
def test_odd_width_raises(device, activation):
    with pytest.raises(ValueError, match="even"):
        activation(torch.randn(2, 7, device=device))


# Each activation with its reference.
ACTIVATIONS = pytest.mark.parametrize(
    "activation, reference",
    [(silu_and_mul, silu_and_mul_reference), (gelu_tanh_and_mul, gelu_tanh_and_mul_reference)],
    ids=["silu", "gelu_tanh"],
)


def _check_triton(device, dtype, shape, activation, reference):
    gen = torch.Generator().manual_seed(shape[-1])
    # Rows of a wider tensor: the kernel must follow the row stride.
    wide = (torch.randn(*shape[:-1], shape[-1] + 6, generator=gen) * 4).to(dtype).to(device)
    x = wide[..., : shape[-1]]
    if x.numel():
        x[..., 0] = -60.0  # far in the tail, where exp overflows: 0, not NaN
    before = x.clone()
    out = activation(x)
    assert torch.equal(x, before)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, reference(x), **_TOLERANCE[dtype])


# The interpreter's numpy warns of the tail's exp overflowing, which the kernel relies on.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@ACTIVATIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 100), (3, 2 * 1500), (2, 3, 2 * 64), (0, 8)])
def test_triton_matches_reference(triton_backend, device, dtype, shape, activation, reference):
    # 1500 columns cross the kernel's column block; (2, 3, ...) has two leading dims.
    _check_triton(device, dtype, shape, activation, reference)


@pytest.mark.gpu
@ACTIVATIONS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (257, 2 * 8960), (64, 2 * 14336)])
def test_gpu_triton_matches_reference(triton_backend, device, dtype, shape, activation, reference):
    _check_triton(device, dtype, shape, activation, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_reference_matches_torchs_gelu(device, dtype):
    x = (torch.randn(6, 2 * 50, device=device) * 4).to(dtype)
    gate, up = x.double()[:, :50], x.double()[:, 50:]
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    out = gelu_tanh_and_mul_reference(x)
    assert out.shape == (6, 50) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **_TOLERANCE[dtype])
    # The tanh approximation, not the exact GELU: they differ by far more than the tolerance.
    exact = torch.nn.functional.gelu(gate) * up
    assert (out.double() - exact).abs().max() > 1e-3
