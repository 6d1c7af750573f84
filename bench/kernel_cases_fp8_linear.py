"""The cases of the FP8 W8A8 linear layers (aioserve/kernels/fp8_linear.py, and
fp8_block_linear.py's block-wise ones), built for bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (kernel_cases_linear.linear_layers)
with per-channel weight scales, and with a scale a 128 × 128 block (DeepSeek's and Qwen3's
FP8 checkpoints), for each token batch and activation dtype. The 8-bit
format is the device's e4m3 (`platform.e4m3_dtype`: fnuz on MI300), so that the no-GPU
compile test, which makes the platform module answer for each target, builds each
target's own; none where the device has no e4m3. A weight is drawn once
(`random_weight`) and shared by its layer's cases.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels import fp8_block_linear, fp8_linear
from aioserve.kernels.fp8_block_linear_reference import fp8_block_linear_reference, scale_shape
from aioserve.kernels.fp8_linear_reference import fp8_linear_reference
from aioserve.platform import e4m3_dtype, e4m3_missing
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare
from bench.kernel_cases_linear import linear_layers

# In the notation of kernel_cases.FORMULAS (e bytes per element of x): the weight is read
# once, a byte a weight; x is read twice (its scale, then its 8-bit copy written and read).
FORMULAS = {
    "fp8_linear": "x [M, K] read twice + x_q [M, K] written and read + W [N, K] read (1 byte) "
    "+ out [M, N] written: 2·M·K·e + 2·M·K + N·K + M·N·e",
    "fp8_block_linear": "x [M, K] read once + x_q [M, K] written and read + W [N, K] read "
    "(1 byte) + out [M, N] written (scales, 4 bytes a 128-column group, left out): "
    "M·K·e + 2·M·K + N·K + M·N·e",
}
BLOCK = (128, 128)


def random_weight(rand: Random, n: int, k: int, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """e4m3 values [N, K] from random bytes and per-row scales around 0.01: weights under
    ±0.025, as a real layer's. The bytes are drawn eight to an int64: a float32 weight
    drawn and quantized cost seconds a compile test."""
    codes = rand.bytes(n, k)
    codes &= 0xBF  # the exponent's top bit cleared: magnitudes under 2, never a NaN code
    codes[codes == 0x80] = 0  # −0, which e4m3fnuz reads as NaN
    return codes.view(fp8_dtype), rand.uniform(n).mul_(0.005).add_(0.0075)


def _case(
    rand: Random,
    model: ModelShape,
    layer: str,
    weight: Tensor,
    scale: Tensor,
    batch: TokenBatch,
    dtype: torch.dtype,
    blockwise: bool = False,
) -> Case:
    """One product: per-channel scales (fp8_linear), or a scale a BLOCK (fp8_block_linear),
    whose quantizer reads x once rather than twice."""
    n, k = weight.shape
    x = rand.normal(batch.n, k, dtype=dtype)
    e = x.element_size()
    x_reads = 1 if blockwise else 2
    traffic = x_reads * batch.n * k * e + 2 * batch.n * k + n * k + batch.n * n * e

    def run() -> Tensor:
        if blockwise:
            return fp8_block_linear.fp8_block_linear_triton(x, weight, scale, BLOCK)
        return fp8_linear.fp8_linear_triton(x, weight, scale)

    def check() -> str | None:
        if blockwise:
            return compare(run(), fp8_block_linear_reference(x, weight, scale, BLOCK), dtype)
        return compare(run(), fp8_linear_reference(x, weight, scale), dtype)

    family = "fp8_block_linear" if blockwise else "fp8_linear"
    label = f"{layer}, {batch.label}"
    return Case(family, model.name, label, dtype, traffic, 2 * batch.n * n * k, run, check)


def fp8_linear_cases(
    rand: Random,
    model: ModelShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """Every layer of `model` in the device's e4m3, with per-channel and then block scales,
    for each batch and dtype."""
    if e4m3_missing() is not None:
        return
    fp8_dtype = e4m3_dtype()
    for layer, n, k in linear_layers(model):
        weight, scale = random_weight(rand, n, k, fp8_dtype)
        for batch in batches:
            for dtype in dtypes:
                yield _case(rand, model, layer, weight, scale, batch, dtype)
        rows, columns = scale_shape(n, k, BLOCK)
        block_scale = rand.uniform(rows * columns).mul_(0.005).add_(0.0075).view(rows, columns)
        for batch in batches:
            for dtype in dtypes:
                yield _case(rand, model, layer, weight, block_scale, batch, dtype, True)
