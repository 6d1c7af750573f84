"""The fixed-tile Triton GEMM of batch-invariant mode (aioserve/kernels/dense_linear.py)
against its float32 reference, and a row's bits alone against the same row in a batch.

Under TRITON_INTERPRET=1 (the test session's setting) in float16 and float32: the
interpreter's tl.dot on bfloat16 multiplies bit patterns. `pytest -m gpu` runs the
bfloat16 cases compiled.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import dispatch
from aioserve.kernels.dense_linear import dense_linear_reference, dense_linear_triton
from aioserve.models.linear import dense

INTERPRETED = [torch.float16, torch.float32]


def _inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(device, dtype)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(device, dtype)
    bias = torch.randn(n, generator=generator).to(device, dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype", INTERPRETED)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 40), (19, 33, 48), (40, 16, 16)])
def test_the_kernel_gives_the_references_product(triton_backend, dtype, m, n, k):
    x, weight, bias = _inputs(m, n, k, dtype, torch.device("cpu"))
    for b in (None, bias):
        got = dense_linear_triton(x, weight, b)
        expected = dense_linear_reference(x, weight, b)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", INTERPRETED)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(triton_backend, dtype):
    # K not a multiple of the tile's depth and N not of its width: the masked steps too.
    x, weight, bias = _inputs(37, 40, 56, dtype, torch.device("cpu"), seed=1)
    batched = dense_linear_triton(x, weight, bias)
    for i in (0, 15, 16, 36):
        assert torch.equal(dense_linear_triton(x[i : i + 1], weight, bias)[0], batched[i])
    # The same row among other neighbours, at another place in its tile.
    shuffled = torch.cat([x[20:], x[:20]])
    assert torch.equal(dense_linear_triton(shuffled, weight, bias)[17], batched[0])


def test_dense_takes_the_kernel_in_batch_invariant_mode_where_triton_runs(triton_backend):
    x, weight, bias = _inputs(5, 24, 32, torch.float16, torch.device("cpu"), seed=2)
    dispatch.set_batch_invariant(True)
    try:
        got = dense(x, weight, bias)
    finally:
        dispatch.set_batch_invariant(False)
    assert torch.equal(got, dense_linear_triton(x, weight, bias))


def test_bad_inputs_are_refused():
    x, weight, bias = _inputs(2, 8, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        dense_linear_reference(x[:, :8], weight)
    with pytest.raises(ValueError, match="share one of"):
        dense_linear_reference(x, weight.half())
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        dense_linear_reference(x, weight, bias[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_on_a_gpu_a_row_gets_the_same_bits_in_any_batch(dtype):
    device = torch.device("cuda")
    x, weight, bias = _inputs(300, 1000, 1030, dtype, device, seed=3)
    batched = dense_linear_triton(x, weight, bias)
    torch.testing.assert_close(
        batched, dense_linear_reference(x, weight, bias), rtol=2e-2, atol=2e-2
    )
    for i in (0, 1, 127, 128, 299):
        assert torch.equal(dense_linear_triton(x[i : i + 1], weight, bias)[0], batched[i])
