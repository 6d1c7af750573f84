"""INT8 W8A8 linear layers on a GPU: y = (x_q W_qᵀ) · s_x · s_w (+ bias),
int8_linear_reference.py states the format.

Two launches a product, as fp8_linear.py's:

- `_quantize_rows_int8_kernel`: one program a row of x, two passes over it: the row's
  largest magnitude gives its scale s_x = max |x| / 127, then x / s_x is rounded to the
  nearest integer (ties to even) into an int8 [M, K] buffer. Both divisions are rounded
  to nearest (tl.div_rn; a GPU's plain float32 division may be off by an ulp), so the
  bytes and scales are the reference's exactly;
- fp8_linear's `_gemm_kernel` (`launch_gemm`) with INT8 set: tl.dot on the int8 tiles
  (int8 tensor cores on NVIDIA from sm_80, MFMA/WMMA on AMD), summed in int32, which is
  exact in any order; then the float32 scaling in the reference's order, compiled without
  fused multiply-adds. A GPU should thus give the reference's bits (the GPU test checks
  it); Triton's interpreter does, but for bfloat16 outputs, which it truncates.

The tiles are `_GEMM_CONFIG`'s, picked as fp8_linear's are (the "small" one for up to 16
rows, else the "large" one; always the large one in batch-invariant mode). The small tile
walks K twice as deep as fp8's; the large one is 128 × 128 × 64 everywhere (on sm_90a
twice fp8's width: the int32 sum needs no second accumulator). Each entry compiles
without a register spill and within the family's shared memory on sm_90a, sm_80, gfx942,
gfx90a and gfx1100 (tests/kernels/test_gpu_compile.py). The CPU entries serve Triton's
interpreter (the tests); on the CPU `int8_linear` runs the reference (torch's int8 GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.fp8_linear import QUANTIZE_BLOCK, X_DTYPES, launch_gemm
from aioserve.kernels.int8_linear_reference import (
    INT8_MAX,
    MIN_SCALE,
    check_int8_linear,
    int8_linear_reference,
)
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Shaped as fp8_linear.GEMM_CONFIG; each entry chosen by compiling it for its families
# (tests/kernels/gpu_compile.py; spills in bytes on NVIDIA, registers on AMD). Small tile:
# 16 × 32 as fp8's, K 256 deep (fp8's: 128), 8 KiB of W a step. Large tile: 128 × 128, K
# 64 deep, on every family: 128 deep spilled on each (344 on sm_90a, 648 on sm_80, 24 on
# gfx942, 31 on gfx90a, 161 on gfx1100), 128 × 64 × 128 on sm_80 (216) and gfx1100 (46),
# and 4 warps on sm_90a (1,344 at 128 × 64 × 128). fp8's sm_90a tile is 128 × 64 for its
# second float32 accumulator, which the int32 sum does without.
_GEMM_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3},
        "large": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    },
    "rocm": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 2},
        "large": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
    # gfx1100 (wave32): "rocm"'s small tile spilled 290 registers (78 with K in whole steps).
    "rdna3": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2},
        "large": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
    "cpu": {
        "small": {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 1, "num_stages": 1},
        "large": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 1, "num_stages": 1},
    },
}  # fmt: skip
# The row quantizer's block of columns and the inputs taken are fp8_linear's (QUANTIZE_BLOCK,
# X_DTYPES): the two quantizers read x alike.
# Added to and taken from a float32 |v| < 2**22, it leaves v rounded to an integer, ties to
# even: the sum's last mantissa bit is worth 1 (float32's own rounding does the work).
_ROUNDER = 1.5 * 2.0**23


@triton.jit
def _quantize_rows_int8_kernel(
    x_ptr,
    x_q_ptr,
    x_scale_ptr,
    k,
    stride_x,
    INT8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUNDER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    largest = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(values))
    scale = tl.maximum(tl.div_rn(tl.max(largest, axis=0), INT8_MAX), MIN_SCALE)
    tl.store(x_scale_ptr + row, scale)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        # Clamped first (to what the reference clamps to after rounding: the same, as
        # ±127 are integers), so that |v| is far below 2**22.
        scaled = tl.clamp(tl.div_rn(values, scale), -INT8_MAX, INT8_MAX)
        rounded = (scaled + ROUNDER) - ROUNDER
        tl.store(x_q_ptr + row * k + cols, rounded.to(tl.int8), mask=cols < k)


def quantize_rows_int8_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    """The Triton path of int8_linear_reference.quantize_rows: x [M, K] as int8 [M, K] and
    float32 scales [M], bit for bit the reference's."""
    num_rows, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    x_q = torch.empty((num_rows, k), dtype=torch.int8, device=x.device)
    x_scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_rows_int8_kernel[(num_rows,)](
            x,
            x_q,
            x_scale,
            k,
            x.stride(0),
            INT8_MAX=INT8_MAX,
            MIN_SCALE=MIN_SCALE,
            ROUNDER=_ROUNDER,
            BLOCK_K=launch_entry(QUANTIZE_BLOCK),
        )
    return x_q, x_scale


def int8_linear_triton(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """The Triton path of `int8_linear`."""
    check_int8_linear(x, weight, scale, bias)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    num_rows = x.shape[0]
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    x_q, x_scale = quantize_rows_int8_triton(x)
    launch_gemm(x_q, x_scale, weight.contiguous(), scale, bias, out, _GEMM_CONFIG)
    return out


def int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias [N]) as [M, N] in x's dtype, W [N, K] = weight · scale being an
    INT8 W8A8 weight (int8 in [-127, 127]) with float32 scales [N] or [1]; x is quantized
    per row to int8 (int8_linear_reference.py)."""
    if dispatch.use_triton():
        return int8_linear_triton(x, weight, scale, bias)
    return int8_linear_reference(x, weight, scale, bias)
