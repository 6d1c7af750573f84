"""Sparse mixture-of-experts with block-wise FP8 experts: the torch reference against a
naive float64 loop over the (token, choice) pairs with the format written out (each
product's input rounded to e4m3 per row and group, tests/kernels/test_fp8_block_linear.py's
`_loop_groups`), and the Triton path (interpreted on the CPU) against the reference.

Under the interpreter the tile is 16 pairs × 16 columns, K in steps of 32 cut to the group:
the shapes reach groups of 16 (steps cut), 32 and 64 (two steps a group), a K tail inside
the last group (H 80 in groups of 64), w13's scales a weight row each (a stacked gate/up
whose gate does not end on a block boundary) and in blocks, experts with no pair, one token
and none. float32 and float16 activations (tl.dot on bfloat16 is wrong under the
interpreter); the GPU test takes bfloat16 at Qwen3-30B-A3B's shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioserve.kernels.fp8_block_linear_reference import dequantize_blocks, quantize_weight_blocks
from aioserve.kernels.moe import fused_moe, fused_moe_triton
from aioserve.kernels.moe_reference import (
    MoeFp8Scales,
    check_moe,
    fused_moe_fp8_reference,
    fused_moe_reference,
    select_experts,
)
from tests.kernels.test_fp8_block_linear import _loop_groups

_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
_NUM_EXPERTS = 6
# (H, I, w13's block rows, w2's block rows, group)
_SHAPES = {
    "128x128-like, gate spread": (64, 48, 1, 32, 32),
    "blocks, K tail": (80, 32, 16, 48, 64),
    "groups of 16": (48, 32, 32, 16, 16),
}


def _experts(hidden: int, inter: int, w13_rows: int, w2_rows: int, group: int, seed: int):
    """(w13 e4m3, w2 e4m3, their MoeFp8Scales, the dequantized float32 w13 and w2)."""
    gen = torch.Generator().manual_seed(seed)
    w13_float = torch.randn(_NUM_EXPERTS, 2 * inter, hidden, generator=gen) * 0.2
    w2_float = torch.randn(_NUM_EXPERTS, hidden, inter, generator=gen) * 0.2
    w13 = [quantize_weight_blocks(w, (w13_rows, group), torch.float8_e4m3fn) for w in w13_float]
    w2 = [quantize_weight_blocks(w, (w2_rows, group), torch.float8_e4m3fn) for w in w2_float]
    scales = MoeFp8Scales(
        torch.stack([s for _, s in w13]), torch.stack([s for _, s in w2]), w13_rows, w2_rows, group
    )
    dequantized = (
        torch.stack([dequantize_blocks(v, s, (w13_rows, group)) for v, s in w13]),
        torch.stack([dequantize_blocks(v, s, (w2_rows, group)) for v, s in w2]),
    )
    return torch.stack([v for v, _ in w13]), torch.stack([v for v, _ in w2]), scales, dequantized


def _routing(tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, _NUM_EXPERTS, generator=gen)
    logits[:, -1] = -30  # one expert gets no pair
    return select_experts(logits, top_k, True)


def _naive(x, w13_deq, w2_deq, weights, ids, group):
    """Σ_j weight · down(silu(gate) · up), each product's input rounded to e4m3 per row and
    group first and the products summed in float64, pair by pair."""

    def quantized(row: torch.Tensor) -> torch.Tensor:
        values, scales = _loop_groups(row[None].float(), group, torch.float8_e4m3fn)
        return (values.double() * scales.double().repeat_interleave(group, 1)[:, : row.numel()])[0]

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = (w13_deq[e].double() @ quantized(x[t])).to(x.dtype)
            inter = gate_up.shape[0] // 2
            h = (F.silu(gate_up[:inter].float()) * gate_up[inter:].float()).to(x.dtype)
            y = (w2_deq[e].double() @ quantized(h)).to(x.dtype)
            out[t] += weights[t, j].double() * y.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_the_reference_is_the_format_pair_by_pair(shape, dtype):
    hidden, inter, *blocks = _SHAPES[shape]
    w13, w2, scales, (w13_deq, w2_deq) = _experts(hidden, inter, *blocks, seed=1)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = _routing(9, 2, 3)
    out = fused_moe_fp8_reference(x, w13, w2, weights, ids, scales)
    expected = _naive(x, w13_deq, w2_deq, weights, ids, scales.group)
    torch.testing.assert_close(out.double(), expected, **_TOLERANCE[dtype])
    # and near the float experts: e4m3's rounding of the activations, nothing else
    plain = fused_moe_reference(x.float(), w13_deq, w2_deq, weights, ids)
    error = ((out.float() - plain).norm() / plain.norm()).item()
    assert 0 < error < 0.06, error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (11, 2), (7, 4)])
def test_triton_against_the_reference(shape, dtype, tokens, top_k):
    hidden, inter, *blocks = _SHAPES[shape]
    w13, w2, scales, _ = _experts(hidden, inter, *blocks, seed=4)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5)).to(dtype)
    weights, ids = _routing(tokens, top_k, 6)
    out = fused_moe_triton(x, w13, w2, weights, ids, scales)
    expected = fused_moe_fp8_reference(x, w13, w2, weights, ids, scales)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **_TOLERANCE[dtype])


def test_no_tokens_and_the_cpu_path():
    w13, w2, scales, _ = _experts(48, 32, 32, 16, 16, seed=7)
    weights, ids = _routing(0, 2, 8)
    assert fused_moe_triton(torch.empty(0, 48), w13, w2, weights, ids, scales).shape == (0, 48)
    x = torch.randn(3, 48)
    weights, ids = _routing(3, 2, 9)
    assert torch.equal(
        fused_moe(x, w13, w2, weights, ids, fp8=scales),
        fused_moe_fp8_reference(x, w13, w2, weights, ids, scales),
    )


def test_bad_fp8_operands_are_refused():
    w13, w2, scales, (w13_deq, _) = _experts(48, 32, 32, 16, 16, seed=10)
    x = torch.randn(3, 48)
    weights, ids = _routing(3, 2, 11)
    with pytest.raises(ValueError, match="FP8 experts must be e4m3"):
        check_moe(x, w13_deq, w2, weights, ids, scales)
    wrong = MoeFp8Scales(scales.w13_scale, scales.w2_scale, 16, 16, 16)  # w13 in 16-row blocks
    with pytest.raises(ValueError, match=r"w13's block scales must be float32 \[6, 4, 3\]"):
        check_moe(x, w13, w2, weights, ids, wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_triton_matches_reference(triton_backend, device, tokens):
    # Qwen3-30B-A3B's experts (H 2048, I 768, top 8), 16 of its 128, in 128 x 128 blocks:
    # gate's 768 rows end on a block boundary.
    gen = torch.Generator(device=device).manual_seed(tokens)
    hidden, inter, experts, block = 2048, 768, 16, (128, 128)

    def quantized(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [
            quantize_weight_blocks(
                torch.randn(rows, columns, generator=gen, device=device) * 0.02,
                block,
                torch.float8_e4m3fn,
            )
            for _ in range(experts)
        ]
        return torch.stack([v for v, _ in parts]), torch.stack([s for _, s in parts])

    (w13, w13_scale), (w2, w2_scale) = quantized(2 * inter, hidden), quantized(hidden, inter)
    scales = MoeFp8Scales(w13_scale, w2_scale, *block, block[1])
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = select_experts(logits, 8, True)
    out = fused_moe(x, w13, w2, weights, ids, fp8=scales).double()
    expected = fused_moe_fp8_reference(x, w13, w2, weights, ids, scales).double()
    error = ((out - expected).norm() / expected.norm()).item()
    assert error <= 8e-3
