"""Block-wise FP8 W8A8 linear layers on a GPU: fp8_block_linear_reference.py states the format
(a scale a 128 × 128 block of the weight, a scale a row and 128-column group of the input).

Two launches a product:

- `_quantize_groups_kernel`: a program a row of x and GROUPS_PER_PROGRAM of its column
  groups, each group's largest magnitude giving its scale s_x = max |x| / FP8_MAX, then
  x / s_x rounded to the nearest 8-bit float (fp8_linear.round_to_e4m3) into [M, K];
- fp8_linear's `_gemm_kernel`, BLOCKWISE: tiles of BLOCK_M rows × BLOCK_N output columns
  walking K BLOCK_K at a time (BLOCK_K divides the group, so that a step lies in one
  group): each step's 8-bit product, summed in float32, is scaled by its rows' and
  columns' scales of that group and added into the float32 accumulator; the bias is added
  once at the end.

The tiles are fp8_linear.GEMM_CONFIG's (one of gfx1100's excepted; BLOCK_K cut to the
group where it is wider), picked as fp8_linear's are: the "small" one for up to 16 rows,
the "large" one beyond and in batch-invariant mode. K is not split and the steps are
summed in order, so the result is deterministic. On the CPU the model's FP8 weights are
dequantized at load, so these kernels run on GPUs only (and under Triton's interpreter in
the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.fp8_block_linear_reference import (
    check_fp8_block_linear,
    fp8_block_linear_reference,
)
from aioserve.kernels.fp8_linear import (
    E4M3_MIN_NORMAL,
    GEMM_CONFIG,
    QUANTIZE_BLOCK,
    X_DTYPES,
    launch_gemm,
    round_to_e4m3,
)
from aioserve.kernels.fp8_linear_reference import FP8_MAX, MIN_SCALE
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# tl.dot's least depth: a group narrower than this cannot be a step of the product.
MIN_GROUP = 16
# fp8_linear's tiles, but for gfx1100 (wave32), whose large tile spilled 26 bytes blockwise
# (a step's product is held beside the accumulator): 128 × 32 compiles without.
_GEMM_CONFIG = GEMM_CONFIG | {
    "rdna3": {
        "small": GEMM_CONFIG["rdna3"]["small"],
        "large": {"block_m": 128, "block_n": 32, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
}


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    x_q_ptr,
    x_scale_ptr,
    k,
    num_groups,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < k  # groups past the last one start past k
    values = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(values), axis=1) / FP8_MAX, MIN_SCALE)
    tl.store(x_scale_ptr + row * num_groups + groups, scale, mask=groups < num_groups)
    scaled = tl.clamp(tl.div_rn(values, scale[:, None]), -FP8_MAX, FP8_MAX)
    rounded = round_to_e4m3(scaled, MIN_NORMAL, SUBNORMAL_STEP)
    tl.store(x_q_ptr + row * k + cols, rounded.to(x_q_ptr.dtype.element_ty), mask=mask)


def check_triton_group(group: int) -> None:
    """Raise ValueError for a group of input columns the kernels cannot step through: a
    power of two of at least MIN_GROUP (checkpoints use 128)."""
    if group < MIN_GROUP or group & (group - 1):
        raise ValueError(
            f"block-wise FP8 on a GPU needs column blocks of a power of two of at least "
            f"{MIN_GROUP}, got {group}"
        )


def quantize_groups_triton(x: Tensor, group: int, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The Triton path of fp8_block_linear_reference.quantize_groups: x [M, K] as
    `fp8_dtype` [M, K] and float32 scales [M, ⌈K / group⌉]."""
    check_triton_group(group)
    num_rows, k = x.shape
    num_groups = -(-k // group)
    x = x if x.stride(1) == 1 else x.contiguous()
    x_q = torch.empty((num_rows, k), dtype=fp8_dtype, device=x.device)
    x_scale = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows and k:
        per_program = max(1, launch_entry(QUANTIZE_BLOCK) // group)
        _quantize_groups_kernel[(num_rows, triton.cdiv(num_groups, per_program))](
            x,
            x_q,
            x_scale,
            k,
            num_groups,
            x.stride(0),
            FP8_MAX=FP8_MAX[fp8_dtype],
            MIN_NORMAL=E4M3_MIN_NORMAL[fp8_dtype],
            SUBNORMAL_STEP=E4M3_MIN_NORMAL[fp8_dtype] / 8,
            MIN_SCALE=MIN_SCALE,
            GROUP=group,
            GROUPS_PER_PROGRAM=per_program,
        )
    return x_q, x_scale


def fp8_block_linear_triton(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None = None
) -> Tensor:
    """The Triton path of `fp8_block_linear`."""
    check_fp8_block_linear(x, weight, scale, block, bias)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    num_rows = x.shape[0]
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    x_q, x_scale = quantize_groups_triton(x, block[1], weight.dtype)
    launch_gemm(
        x_q, x_scale, weight.contiguous(), scale.contiguous(), bias, out, _GEMM_CONFIG, block
    )
    return out


def fp8_block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias [N]) as [M, N] in x's dtype, W [N, K] being a block-wise FP8
    weight (e4m3fn, or e4m3fnuz on ROCm) with float32 scales a block of `block` (rows,
    columns); x is quantized per row and group of block[1] columns to the same format
    (fp8_block_linear_reference.py)."""
    if dispatch.use_triton():
        return fp8_block_linear_triton(x, weight, scale, block, bias)
    return fp8_block_linear_reference(x, weight, scale, block, bias)
