"""The dense layer: the same product as F.linear whichever way round the GEMM is done,
bfloat16 row weights that hold the rounded weights' values, and weights packed for oneDNN
that give F.linear's products on the weights they replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioserve.kernels import dispatch
from aioserve.models.linear import (
    SMALL_BATCH_ROWS,
    Linear,
    dense,
    keep_row_weights,
    onednn_packs,
    pack_weights,
)
from tests.models.tiny_models import hf_and_ours, tiny_configs


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
    with torch.no_grad():  # left uninitialized: the loader fills them
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(5, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_row_weights_are_the_rounded_weights_in_bfloat16() -> None:
    config = tiny_configs()["qwen2-tied"]
    _, model = hf_and_ours(config)
    before = model.layers[0].self_attn.qkv_proj.weight.clone()
    added = keep_row_weights(model, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in linears:
        assert layer.row_weight.dtype == torch.bfloat16
        assert torch.equal(layer.weight, layer.row_weight.float())
    assert torch.equal(model.embed_tokens.weight, model.head_row_weight.float())
    assert (
        added == sum(m.weight.numel() * 2 for m in linears) + model.embed_tokens.weight.numel() * 2
    )
    # Rounded, not replaced: every weight moved by at most bfloat16's half step.
    rounded = model.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(rounded, before)
    torch.testing.assert_close(rounded, before, rtol=2**-8, atol=0)
    assert "row_weight" not in "".join(model.state_dict())


def test_compiled_single_row_reads_the_row_weight() -> None:
    weight = torch.randn(160, 96)
    narrow = weight.to(torch.bfloat16)
    x = torch.randn(1, 96)
    product = torch.compile(dense, dynamic=False)
    out = product(x, weight, None, narrow)
    torch.testing.assert_close(out, F.linear(x, narrow.float()), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_batch_invariant_mode_gives_each_row_the_same_bits_whatever_its_batch():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(37, 40, generator=gen)
    dispatch.set_batch_invariant(True)
    try:
        together = dense(x, weight, bias)
        alone = [dense(x[i : i + 1], weight, bias) for i in range(x.shape[0])]
        in_threes = [dense(x[i : i + 3], weight, bias)[0:1] for i in range(x.shape[0] - 2)]
    finally:
        dispatch.set_batch_invariant(False)
    assert together.shape == (37, 96)
    torch.testing.assert_close(together, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for i, row in enumerate(alone):
        assert torch.equal(row, together[i : i + 1]), i
    for i, row in enumerate(in_threes):
        assert torch.equal(row, together[i : i + 1]), i


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 packed products"
)
def test_packed_weights_give_f_linears_products_on_the_released_weights() -> None:
    config = tiny_configs()["qwen2-tied"]  # biases on qkv, a tied output head
    _, model = hf_and_ours(config)
    model.to(torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    plain = {id(m): (m.weight.detach().clone(), m.bias) for m in linears}
    table = model.embed_tokens.weight.detach().clone()
    added = pack_weights(model)
    assert added == table.nbytes  # the head's copy; each Linear's weight is replaced
    generator = torch.Generator().manual_seed(0)
    for layer in linears:
        weight, bias = plain[id(layer)]
        assert layer.weight.shape == weight.shape and layer.weight.stride() == (0, 0)
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
            out = layer(x)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.bfloat16
            # bfloat16 products, float32 accumulation: oneDNN's own, as F.linear's are.
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    hidden = torch.randn(3, config.hidden_size, generator=generator).to(torch.bfloat16)
    torch.testing.assert_close(
        model.compute_logits(hidden), F.linear(hidden.float(), table.float()), rtol=1e-2, atol=1e-2
    )
