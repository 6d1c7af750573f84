"""The cases of the sparse mixture-of-experts block (aioserve/kernels/moe.py), built for
bench/kernel_cases.py.

Per MoE shape, the experts' products of one layer (`fused_moe_triton`: the pairs' alignment,
the gate/up and down grouped GEMMs, silu·mul and the sum over the choices) for each token
batch (T tokens) and dtype. A shape's experts are built once a dtype and shared by its
cases, each weight normal over √(its K) (outputs of about unit spread); each case routes
its tokens through random router logits (softmax, top_k, renormalized, as Mixtral).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from aioserve.kernels.moe import fused_moe_triton
from aioserve.kernels.moe_reference import fused_moe_reference, select_experts
from bench.kernel_case_types import Case, Random, TokenBatch, compare


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
}


def _case(
    rand: Random,
    moe: MoEShape,
    experts: tuple[torch.Tensor, torch.Tensor],
    batch: TokenBatch,
    dtype: torch.dtype,
) -> Case:
    w13, w2 = experts
    x = rand.normal(batch.n, moe.hidden, dtype=dtype)
    logits = rand.normal(batch.n, moe.experts)
    topk_weights, topk_ids = select_experts(logits, moe.top_k, renormalize=True)
    used = int(torch.unique(topk_ids).numel())
    e = x.element_size()
    per_expert = 3 * moe.intermediate * moe.hidden * e
    traffic = 2 * batch.n * moe.hidden * e + used * per_expert + 8 * batch.n * moe.top_k
    flops = 6 * batch.n * moe.top_k * moe.intermediate * moe.hidden

    def run() -> torch.Tensor:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)

    def check() -> str | None:
        return compare(run(), fused_moe_reference(x, w13, w2, topk_weights, topk_ids), dtype)

    label = f"E{moe.experts} top{moe.top_k}, {batch.label}"
    return Case("fused_moe", moe.name, label, dtype, traffic, flops, run, check)


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
