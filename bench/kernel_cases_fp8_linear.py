"""The cases of the FP8 W8A8 linear layers (aioserve/kernels/fp8_linear.py), built for
bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (kernel_cases_linear.linear_layers)
with per-channel weight scales, for each token batch and activation dtype. The 8-bit
format is the platform's e4m3 (fnuz on ROCm), asked of the kernel module so that the
no-GPU compile test, which makes that module answer "cuda" or "rocm", builds each
target's own. A weight is random normal, quantized once and shared by its layer's cases.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels import fp8_linear
from aioserve.kernels.fp8_linear_reference import (
    fp8_dtype_for,
    fp8_linear_reference,
    quantize_weight,
)
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare
from bench.kernel_cases_linear import linear_layers

# In the notation of kernel_cases.FORMULAS (e bytes per element of x): the weight is read
# once, a byte a weight; x is read twice (its scale, then its 8-bit copy written and read).
FORMULAS = {
    "fp8_linear": "x [M, K] read twice + x_q [M, K] written and read + W [N, K] read (1 byte) "
    "+ out [M, N] written: 2·M·K·e + 2·M·K + N·K + M·N·e"
}


def _case(
    rand: Random,
    model: ModelShape,
    layer: str,
    weight: Tensor,
    scale: Tensor,
    batch: TokenBatch,
    dtype: torch.dtype,
) -> Case:
    n, k = weight.shape
    x = rand.normal(batch.n, k, dtype=dtype)
    e = x.element_size()
    traffic = 2 * batch.n * k * e + 2 * batch.n * k + n * k + batch.n * n * e

    def check() -> str | None:
        out = fp8_linear.fp8_linear_triton(x, weight, scale)
        return compare(out, fp8_linear_reference(x, weight, scale), dtype)

    return Case(
        "fp8_linear",
        model.name,
        f"{layer}, {batch.label}",
        dtype,
        traffic,
        2 * batch.n * n * k,
        lambda: fp8_linear.fp8_linear_triton(x, weight, scale),
        check,
    )


def fp8_linear_cases(
    rand: Random,
    model: ModelShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """Every layer of `model` in the platform's e4m3, for each batch and dtype."""
    fp8_dtype = fp8_dtype_for(fp8_linear.current_platform())
    for layer, n, k in linear_layers(model):
        weight, scale = quantize_weight(rand.normal(n, k, scale=0.02), fp8_dtype)
        for batch in batches:
            for dtype in dtypes:
                yield _case(rand, model, layer, weight, scale, batch, dtype)
