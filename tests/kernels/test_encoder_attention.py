"""encoder_attention: the torch reference and the Triton kernel (interpreted on the CPU)
against a naive float64 softmax(QKᵀ)V per sequence, and batch invariance.

q, k and v are strided views of one fused projection [T, 3 · heads · head_dim], as the
BERT layer hands them over. The interpreter's tiles are 16 rows and 16 keys, so the
lengths below cover one token, odd lengths, exactly one tile and several tiles.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.encoder_attention import encoder_attention, encoder_attention_triton
from aioserve.kernels.encoder_attention_reference import encoder_attention_reference

_TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
_BATCHES = {
    "one token": [1],
    "odd lengths": [5, 1, 13],
    "one tile": [16],
    "longer than a tile": [33, 7, 1, 40],
}


def make_inputs(
    lengths: list[int],
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v [T, heads, head_dim] as views of one fused projection, cu_seqlens, max_seqlen."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    width = num_heads * head_dim
    fused = (torch.randn(num_tokens, 3 * width, generator=gen) * 1.5).to(dtype).to(device)
    q, k, v = (x.view(num_tokens, num_heads, head_dim) for x in fused.split(width, dim=1))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens.to(device), max(lengths, default=0)


def naive(q, k, v, cu_seqlens, scale) -> torch.Tensor:
    """softmax(q kᵀ · scale) v per sequence, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[start:end].double().cpu().transpose(0, 1) for x in (q, k, v))
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (weights @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("batch", list(_BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, head_dim", [(3, 32), (2, 64)])
def test_reference_matches_naive(device, batch, dtype, num_heads, head_dim):
    q, k, v, cu_seqlens, max_seqlen = make_inputs(
        _BATCHES[batch], num_heads, head_dim, dtype, device
    )
    scale = head_dim**-0.5
    out = encoder_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = naive(q, k, v, cu_seqlens, scale)
    torch.testing.assert_close(out.double().cpu(), expected, **_TOLERANCE[dtype])


@pytest.mark.parametrize("batch", list(_BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads, head_dim", [(2, 32), (1, 64)])
def test_triton_matches_reference_and_naive(
    triton_backend, device, batch, dtype, num_heads, head_dim
):
    q, k, v, cu_seqlens, max_seqlen = make_inputs(
        _BATCHES[batch], num_heads, head_dim, dtype, device
    )
    scale = head_dim**-0.5
    out = encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    assert out.dtype == dtype and out.shape == q.shape
    reference = encoder_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale)
    torch.testing.assert_close(out, reference, **_TOLERANCE[dtype])
    torch.testing.assert_close(
        out.double().cpu(), naive(q, k, v, cu_seqlens, scale), **_TOLERANCE[dtype]
    )


def test_triton_head_dim_not_a_power_of_two(triton_backend, device):
    # 48 lanes of a 64-lane tile: the masked lanes must stay out of the dot products.
    q, k, v, cu_seqlens, max_seqlen = make_inputs([9, 20], 2, 48, torch.float32, device)
    out = encoder_attention(q, k, v, cu_seqlens, max_seqlen, 48**-0.5)
    torch.testing.assert_close(
        out.double().cpu(), naive(q, k, v, cu_seqlens, 48**-0.5), **_TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_a_sequences_output_does_not_depend_on_its_batch(device, implementation):
    """Bitwise the same alone and at any place in a batch: the packed offset changes how
    the sequence's rows sit against the batch's tile numbering, not its own tiles."""
    attend = encoder_attention_triton if implementation == "triton" else encoder_attention_reference
    lengths = [21, 3, 37, 1, 16]
    dtype = torch.float16
    q, k, v, cu_seqlens, max_seqlen = make_inputs(lengths, 2, 32, dtype, device)
    batched = attend(q, k, v, cu_seqlens, max_seqlen, 0.2)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone_cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        alone = attend(q[start:end], k[start:end], v[start:end], alone_cu, end - start, 0.2)
        assert torch.equal(alone, batched[start:end]), (start, end)


@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_writes_into_out_and_leaves_padding_rows(device, implementation):
    attend = encoder_attention_triton if implementation == "triton" else encoder_attention_reference
    q, k, v, cu_seqlens, max_seqlen = make_inputs([6, 11], 2, 32, torch.float32, device)
    # Four padding rows past cu_seqlens[-1], as a padded step would have.
    q, k, v = (torch.cat([x, torch.full_like(x[:4], float("nan"))]) for x in (q, k, v))
    out = torch.full(q.shape, 7.0, device=device)
    result = attend(q, k, v, cu_seqlens, max_seqlen, 0.25, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.all(out[17:] == 7.0)
    torch.testing.assert_close(
        out[:17].double().cpu(),
        naive(q[:17], k[:17], v[:17], cu_seqlens, 0.25),
        **_TOLERANCE[torch.float32],
    )


def test_an_empty_batch_returns_at_once(triton_backend, device):
    q = torch.empty(0, 2, 32, device=device)
    cu_seqlens = torch.zeros(1, dtype=torch.int32, device=device)
    assert encoder_attention(q, q, q, cu_seqlens, 0, 0.1).shape == (0, 2, 32)


def test_mismatched_shapes_are_refused(device):
    q = torch.zeros(4, 2, 32, device=device)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="alike"):
        encoder_attention_reference(q, q[:, :1], q, cu_seqlens, 4, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, head_dim", [(12, 32), (12, 64), (16, 128)])
def test_compiled_kernel_matches_reference_on_a_gpu(triton_backend, dtype, num_heads, head_dim):
    device = torch.device("cuda")
    lengths = [1, 7, 64, 65, 200, 512, 33]
    q, k, v, cu_seqlens, max_seqlen = make_inputs(lengths, num_heads, head_dim, dtype, device)
    out = encoder_attention(q, k, v, cu_seqlens, max_seqlen, head_dim**-0.5)
    reference = encoder_attention_reference(q, k, v, cu_seqlens, max_seqlen, head_dim**-0.5)
    torch.testing.assert_close(out, reference, **_TOLERANCE[dtype])
