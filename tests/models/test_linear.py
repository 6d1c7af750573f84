"""The dense layer: the same product as F.linear whichever way round the GEMM is done."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioserve.models.linear import SMALL_BATCH_ROWS, Linear, dense


@pytest.mark.parametrize("rows", [1, 7, 64, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_equals_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(160, 96, generator=generator)
    bias = torch.randn(160, generator=generator) if with_bias else None
    out = dense(x, weight, bias)
    assert out.shape == (rows, 160)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_dense_takes_a_strided_input() -> None:
    # The q/k/v split hands on column slices of a wider tensor.
    wide = torch.randn(16, 200)
    x = wide[:, 40:136]
    weight = torch.randn(32, 96)
    torch.testing.assert_close(dense(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_keeps_nn_linear_parameters() -> None:
    layer = Linear(96, 32, bias=True)
    assert isinstance(layer, torch.nn.Linear)
    assert sorted(name for name, _ in layer.named_parameters()) == ["bias", "weight"]
    x = torch.randn(5, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
