"""rms_norm: the torch reference against transformers' LlamaRMSNorm, the Triton kernel
against the reference, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from aioserve.kernels.rms_norm import rms_norm, rms_norm_reference

_TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _hf_norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.device, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_transformers(device, dtype):
    x = torch.randn(6, 96, device=device).to(dtype) * 3
    weight = torch.randn(96, device=device).to(dtype)
    with torch.no_grad():
        expected = _hf_norm(weight, 1e-5)(x)
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-5), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_residual_is_add_then_norm(device, dtype):
    x = torch.randn(5, 64, device=device).to(dtype)
    residual = torch.randn(5, 64, device=device).to(dtype)
    weight = torch.randn(64, device=device).to(dtype)
    out, residual_out = rms_norm_reference(x, weight, 1e-6, residual)
    torch.testing.assert_close(residual_out, x + residual, atol=0, rtol=0)
    with torch.no_grad():
        expected = _hf_norm(weight, 1e-6)(x + residual)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def _check_triton(device, dtype, num_rows, hidden_size, with_residual, weight_dtype=None):
    gen = torch.Generator().manual_seed(num_rows * hidden_size)
    # x is a strided view (rows of a wider tensor), as a slice of a fused projection is.
    wide = (torch.randn(num_rows, hidden_size + 7, generator=gen) * 2).to(dtype).to(device)
    x = wide[:, :hidden_size]
    weight = torch.randn(hidden_size, generator=gen).to(weight_dtype or dtype).to(device)
    residual = torch.randn(num_rows, hidden_size, generator=gen).to(dtype).to(device)
    residual = residual if with_residual else None
    x_before = x.clone()
    residual_before = residual.clone() if with_residual else None

    result = rms_norm(x, weight, 1e-6, residual)
    expected = rms_norm_reference(x, weight, 1e-6, residual)

    assert torch.equal(x, x_before)
    if with_residual:
        assert torch.equal(residual, residual_before)
        out, residual_out = result
        expected_out, expected_residual = expected
        torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=0)
    else:
        out, expected_out = result, expected
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected_out, **_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_rows, hidden_size", [(1, 64), (7, 200), (3, 1500)])
def test_triton_matches_reference(
    triton_backend, device, dtype, with_residual, num_rows, hidden_size
):
    # 1500 is wider than one program's slice in the interpreter: the row is walked in parts.
    _check_triton(device, dtype, num_rows, hidden_size, with_residual)


def test_triton_float32_weight_with_half_input(triton_backend, device):
    _check_triton(device, torch.float16, 4, 128, True, weight_dtype=torch.float32)


def test_triton_no_rows(triton_backend, device):
    x = torch.empty(0, 64, device=device)
    assert rms_norm(x, torch.ones(64, device=device), 1e-6).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_rows, hidden_size", [(1, 128), (37, 576), (64, 4096), (5, 10000)])
def test_gpu_triton_matches_reference(
    triton_backend, device, dtype, with_residual, num_rows, hidden_size
):
    _check_triton(device, dtype, num_rows, hidden_size, with_residual)
