"""The cases of the linear layers on AWQ / GPTQ 4-bit weights
(aioserve/kernels/int4_group_linear.py), built for bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (kernel_cases_linear.linear_layers),
each in two forms: groups of 128 in input order (AWQ's and GPTQ's common case; 64 where K
is not a multiple of 128) and groups of 32 with act-order (x read through a permutation of
K), for each token batch (M rows) and dtype; the qkv product with a bias, as Qwen2's. A
layer's words are built once and shared by its cases: every word uniform, scales uniform
in [2⁻⁹, 2⁻⁷) (a weight spread of about ±0.03, as a real layer's), zero points uniform in
0..15.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels.int4_group_linear import int4_group_linear_triton
from aioserve.kernels.int4_group_linear_reference import PACK, int4_group_linear_reference
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare
from bench.kernel_cases_linear import linear_layers

# (label, group size, act-order)
FORMS = (("g128", 128, False), ("g32 act-order", 32, True))
# The minimum bytes, in the notation of kernel_cases.FORMULAS (M rows of x, N output
# columns, K inputs, G the group size, e bytes per element of x).
FORMULAS = {
    f"int4_group_linear {label}": "x [M, K] read + words + fp16 scales + uint8 zeros read"
    + (" + perm [K]" if act_order else "")
    + " (+ bias) + out [M, N] written: M·K·e + N·K/2 + 3·N·K/G"
    + (" + 4·K" if act_order else "")
    + " (+ N·e) + M·N·e"
    for label, _, act_order in FORMS
}


def _case(
    rand: Random,
    model: ModelShape,
    layer: str,
    label: str,
    operands: tuple[Tensor, Tensor, Tensor, Tensor | None, int],
    batch: TokenBatch,
    dtype: torch.dtype,
) -> Case:
    qweight = operands[0]
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    x = rand.normal(batch.n, k, dtype=dtype)
    bias = rand.normal(n, dtype=dtype) if layer == "qkv" else None  # as Qwen2's
    e = x.element_size()
    stored = sum(t.nbytes for t in operands[:4] if t is not None)
    traffic = batch.n * k * e + stored + batch.n * n * e + (n * e if bias is not None else 0)

    def check() -> str | None:
        out = int4_group_linear_triton(x, *operands, bias)
        return compare(out, int4_group_linear_reference(x, *operands, bias), dtype)

    return Case(
        f"int4_group_linear {label}",
        model.name,
        f"{layer}, {batch.label}",
        dtype,
        traffic,
        2 * batch.n * n * k,
        lambda: int4_group_linear_triton(x, *operands, bias),
        check,
    )


def int4_group_linear_cases(
    rand: Random,
    model: ModelShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """Every layer of `model` in both forms, for each batch and dtype."""
    for layer, n, k in linear_layers(model):
        qweight = rand.integers(-(2**31), 2**31 - 1, k // PACK, n, dtype=torch.int32)
        for label, wanted, act_order in FORMS:
            group = next(g for g in (wanted, 64, 32) if k % g == 0)  # SmolLM2's K = 576
            groups = k // group
            scales = rand.uniform(groups, n).mul_(3 / 512).add_(1 / 512).half()
            zeros = rand.integers(0, 16, groups, n, dtype=torch.uint8)
            perm = rand.permutation(k).to(torch.int32) if act_order else None
            operands = (qweight, scales, zeros, perm, group)
            for batch in batches:
                for dtype in dtypes:
                    yield _case(rand, model, layer, label, operands, batch, dtype)
