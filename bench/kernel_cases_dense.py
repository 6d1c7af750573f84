"""The cases of the fixed-tile dense GEMM of batch-invariant mode
(aioserve/kernels/dense_linear.py), built for bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (kernel_cases_linear.linear_layers),
for each token batch and dtype: what VLLM_BATCH_INVARIANT=1 costs beside the quantized
kernels and, on a GPU, beside the copy rate. The qkv product has a bias, as Qwen2's has. A
weight is drawn once per layer and dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels.dense_linear import dense_linear_reference, dense_linear_triton
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare
from bench.kernel_cases_linear import linear_layers

# In the notation of kernel_cases.FORMULAS (e bytes per element of x and W).
FORMULAS = {
    "dense_linear": "x [M, K] read + W [N, K] read + out [M, N] written: M·K·e + N·K·e + M·N·e"
}


def _case(
    rand: Random,
    model: ModelShape,
    layer: str,
    weight: Tensor,
    bias: Tensor | None,
    batch: TokenBatch,
) -> Case:
    n, k = weight.shape
    x = rand.normal(batch.n, k, dtype=weight.dtype)
    e = x.element_size()

    def check() -> str | None:
        out = dense_linear_triton(x, weight, bias)
        return compare(out, dense_linear_reference(x, weight, bias), weight.dtype)

    return Case(
        "dense_linear",
        model.name,
        f"{layer}, {batch.label}",
        weight.dtype,
        batch.n * k * e + n * k * e + batch.n * n * e,
        2 * batch.n * n * k,
        lambda: dense_linear_triton(x, weight, bias),
        check,
    )


def dense_linear_cases(
    rand: Random,
    model: ModelShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """Every layer of `model`, for each batch and dtype."""
    for layer, n, k in linear_layers(model):
        for dtype in dtypes:
            weight = rand.normal(n, k, dtype=dtype, scale=0.02)
            bias = rand.normal(n, dtype=dtype) if layer == "qkv" else None
            for batch in batches:
                yield _case(rand, model, layer, weight, bias, batch)
