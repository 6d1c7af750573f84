"""The cases of the sparse mixture-of-experts block (aioserve/kernels/moe.py), built for
bench/kernel_cases.py.

Per MoE shape, the experts' products of one layer (`fused_moe_triton`: the pairs' alignment,
the gate/up and down grouped GEMMs, silu·mul and the sum over the choices) for each token
batch (T tokens) and dtype. A shape's experts are built once a dtype and shared by its
cases, each weight normal over √(its K) (outputs of about unit spread); each case routes
its tokens through random router logits (softmax, top_k, renormalized, as Mixtral). Where
the device has e4m3, the same with block-wise FP8 experts ("fused_moe fp8": 128 × 128
blocks, Qwen3-30B-A3B-FP8's format), their bytes drawn as kernel_cases_fp8_linear's are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from aioserve.kernels.fp8_block_linear_reference import scale_shape
from aioserve.kernels.moe import fused_moe_triton
from aioserve.kernels.moe_reference import (
    MoeFp8Scales,
    fused_moe_fp8_reference,
    fused_moe_reference,
    select_experts,
)
from aioserve.platform import e4m3_dtype, e4m3_missing
from bench.kernel_case_types import Case, Random, TokenBatch, compare
from bench.kernel_cases_fp8_linear import random_weight


@dataclass(frozen=True)
class MoEShape:
    """The sizes of one model's MoE layer."""

    name: str
    hidden: int  # H
    intermediate: int  # I, one expert's
    experts: int  # E
    top_k: int  # k


MIXTRAL_8X7B = MoEShape("mixtral-8x7b", 4096, 14336, 8, 2)
QWEN3_30B_A3B = MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8)
SMALL_MOE = MoEShape("moe-576", 576, 256, 8, 2)
TINY_MOE = MoEShape("tiny-moe", 64, 48, 6, 2)

# The minimum bytes, in the notation of kernel_cases.FORMULAS (T tokens, E_used the experts
# the batch routes to, e bytes per element).
FORMULAS = {
    "fused_moe": "x [T, H] read + the used experts' w13 and w2 read + ids and weights "
    "[T, k] + out [T, H] written: 2·T·H·e + E_used·3·I·H·e + 8·T·k",
    "fused_moe fp8": "as fused_moe, the experts one byte a weight (their block scales left "
    "out): 2·T·H·e + E_used·3·I·H + 8·T·k",
}
FP8_BLOCK = (128, 128)


def _case(
    rand: Random,
    moe: MoEShape,
    experts: tuple[torch.Tensor, torch.Tensor],
    batch: TokenBatch,
    dtype: torch.dtype,
    fp8: MoeFp8Scales | None = None,
) -> Case:
    w13, w2 = experts
    x = rand.normal(batch.n, moe.hidden, dtype=dtype)
    logits = rand.normal(batch.n, moe.experts)
    topk_weights, topk_ids = select_experts(logits, moe.top_k, renormalize=True)
    used = int(torch.unique(topk_ids).numel())
    e = x.element_size()
    per_expert = 3 * moe.intermediate * moe.hidden * w13.element_size()
    traffic = 2 * batch.n * moe.hidden * e + used * per_expert + 8 * batch.n * moe.top_k
    flops = 6 * batch.n * moe.top_k * moe.intermediate * moe.hidden

    def run() -> torch.Tensor:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, fp8)

    def check() -> str | None:
        if fp8 is not None:
            expected = fused_moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, fp8)
        else:
            expected = fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
        return compare(run(), expected, dtype)

    label = f"E{moe.experts} top{moe.top_k}, {batch.label}"
    family = "fused_moe" if fp8 is None else "fused_moe fp8"
    return Case(family, moe.name, label, dtype, traffic, flops, run, check)


def _fp8_experts(rand: Random, moe: MoEShape) -> tuple[torch.Tensor, torch.Tensor, MoeFp8Scales]:
    """e4m3 experts in FP8_BLOCK blocks, scales around 0.01 (weights under ±0.025)."""
    h, i, count = moe.hidden, moe.intermediate, moe.experts
    fp8_dtype = e4m3_dtype()
    w13 = random_weight(rand, count * 2 * i, h, fp8_dtype)[0].view(count, 2 * i, h)
    w2 = random_weight(rand, count * h, i, fp8_dtype)[0].view(count, h, i)
    scales = []
    for n, k in ((2 * i, h), (h, i)):
        rows, columns = scale_shape(n, k, FP8_BLOCK)
        scales.append(rand.uniform(count * rows * columns).mul_(0.005).add_(0.0075))
        scales[-1] = scales[-1].view(count, rows, columns)
    return w13, w2, MoeFp8Scales(scales[0], scales[1], *FP8_BLOCK, FP8_BLOCK[1])


def moe_cases(
    rand: Random,
    moe: MoEShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """`moe`'s layer for each dtype and batch."""
    for dtype in dtypes:
        h, i = moe.hidden, moe.intermediate
        w13 = rand.normal(moe.experts, 2 * i, h, dtype=dtype, scale=h**-0.5)
        w2 = rand.normal(moe.experts, h, i, dtype=dtype, scale=i**-0.5)
        for batch in batches:
            yield _case(rand, moe, (w13, w2), batch, dtype)
        del w13, w2
    if e4m3_missing() is not None:
        return
    w13, w2, fp8 = _fp8_experts(rand, moe)
    for dtype in dtypes:
        for batch in batches:
            yield _case(rand, moe, (w13, w2), batch, dtype, fp8)
