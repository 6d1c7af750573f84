"""FP8 W8A8 linear layers on a GPU: y = (x_q W_qᵀ) · s_x · s_w (+ bias), fp8_linear_reference.py
states the format.

Two launches a product:

- `_quantize_rows_kernel`: one program a row of x, two passes over it: the row's largest
  magnitude gives its scale s_x = max |x| / FP8_MAX, then x / s_x is rounded to the
  nearest 8-bit float (ties to even, as torch's cast) into a [M, K] buffer;
- `_gemm_kernel`: tiles of BLOCK_M rows × BLOCK_N output columns, walking K BLOCK_K at a
  time with tl.dot on the 8-bit tiles themselves (H100 and MI300 multiply fp8 in their
  tensor cores; each step's sum is added into a float32 accumulator), then the two scales
  and the bias applied once. INT8 W8A8 layers (int8_linear.py) launch it too
  (`launch_gemm`), on int8 tiles summed exactly in int32, with tiles of their own, and so
  do block-wise FP8 layers (fp8_block_linear.py, BLOCKWISE: each step scaled by its
  group's scales as it is added).

A product moves 1 byte a weight, half of bfloat16. The tile is `GEMM_CONFIG`'s "small" one
(16 rows, tl.dot's least) for up to 16 rows and the "large" one beyond; in batch-invariant
mode (`dispatch.batch_invariant`) always the large one, so that a row's bits do not depend
on what shares its batch. K is not split: each program sums its whole row of K in order,
so the result is deterministic; a decode of one row therefore launches N / BLOCK_N
programs, which leaves part of a GPU idle for the narrowest layers.

The launch tables are fixed per platform and GPU family (platform.launch_entry). The GPU
entries compile without a register spill for sm_90a, gfx942, gfx90a and gfx1100
(tests/kernels/test_gpu_compile.py); an NVIDIA GPU before sm_89 has no e4m3, and FP8
checkpoints are dequantized at load there; bench/RESULTS.md has
their times on an H100. The CPU entries serve Triton's interpreter (the tests). On the CPU
the model's FP8 weights are dequantized at load, so this module's kernels run on GPUs only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.fp8_linear_reference import (
    FP8_MAX,
    MIN_SCALE,
    check_fp8_linear,
    fp8_linear_reference,
)
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

_SMALL_TILE_ROWS = 16
# Small tile: 16 rows (tl.dot's least), 32 columns so that a one-row decode of a
# 4,096-column layer launches 128 programs, K 128 deep (the 8-bit tiles are small: 4 KiB
# of W a step). Large tile: 128 × 128, K 64 deep on gfx942; 128 deep spilled (336 bytes on
# sm_90a, 24 on gfx942) and so did 4 warps (828+ bytes on sm_90a). On sm_90a the float32
# sum of each step (the kernel's comment) needs a second accumulator: 128 × 128 spilled
# 60 bytes, so 128 × 64, which was also the fastest of three spill-free tiles timed on an
# H100 (bench/RESULTS.md).
GEMM_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 3},
        "large": {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3},
    },
    "rocm": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2},
        "large": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
    # gfx1100 (wave32): "rocm"'s small tile spilled 77 bytes, its large one 24.
    "rdna3": {
        "small": {"block_m": 16, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2},
        "large": {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
    "cpu": {
        "small": {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 1, "num_stages": 1},
        "large": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 1, "num_stages": 1},
    },
}  # fmt: skip
QUANTIZE_BLOCK = {"cuda": 1024, "rocm": 1024, "cpu": 32}  # columns of x per step
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The least normal e4m3 number; below it the 3 mantissa bits are steps of an eighth of it.
E4M3_MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e4m3fnuz: 2.0**-7}


@triton.jit
def round_to_e4m3(values, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """float32 `values` rounded to the nearest e4m3 number (ties to even), still as float32:
    then the cast to 8 bits is exact on every backend. (Triton's interpreter loses the carry
    when a cast rounds up into the next power of two: 126.4 became 64 instead of 128.)"""
    # Normal range: keep 3 of float32's 23 mantissa bits, rounding on the 20 dropped ones;
    # a carry out of the mantissa moves the exponent up, as it should.
    bits = values.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # Below MIN_NORMAL the steps are SUBNORMAL_STEP apart: adding 1.5 * 2**23 steps makes
    # float32's own rounding drop exactly the bits below one step.
    magic = 1.5 * 8388608.0 * SUBNORMAL_STEP
    subnormal = (values + magic) - magic
    return tl.where(tl.abs(values) < MIN_NORMAL, subnormal, normal)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    x_q_ptr,
    x_scale_ptr,
    k,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    largest = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(values))
    scale = tl.maximum(tl.max(largest, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(x_scale_ptr + row, scale)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        scaled = tl.clamp(tl.div_rn(values, scale), -FP8_MAX, FP8_MAX)
        rounded = round_to_e4m3(scaled, MIN_NORMAL, SUBNORMAL_STEP)
        tl.store(x_q_ptr + row * k + cols, rounded.to(x_q_ptr.dtype.element_ty), mask=cols < k)


@triton.jit
def _gemm_kernel(
    x_q_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    n,
    k,
    num_groups,
    stride_out,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    INT8: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per (BLOCK_M rows, BLOCK_N columns); the row tiles of one column tile are
    # neighbours in the grid, so they find its weights in L2. W is [N, K] row-major: its
    # tile is loaded K-major, [BLOCK_K, BLOCK_N], as tl.dot's right operand. INT8: the
    # operands are int8 (int8_linear.py), their products summed in int32, exactly.
    # BLOCKWISE: block-wise FP8 (fp8_block_linear.py), x's scales [M, num_groups] and W's
    # [⌈N / SCALE_ROWS⌉, num_groups]; each step (within one group of GROUP columns) is
    # scaled by its group's scales as it is added.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < n
    depth = tl.arange(0, BLOCK_K)
    # The loop loads without row or column masks: a partial tile's extra rows and columns
    # re-read real ones (the indices wrap) and are never stored. Its pointers start at the
    # first K step and advance by BLOCK_K, rather than being rebuilt each step: with masks
    # and rebuilt 64-bit offsets the 128 × 128 tile spilled on sm_90a.
    x_at = x_q_ptr + (rows % num_rows).to(tl.int64)[:, None] * k + depth[None, :]
    w_at = w_ptr + (cols % n).to(tl.int64)[None, :] * k + depth[:, None]
    if BLOCKWISE:
        x_scale_at = x_scale_ptr + (rows % num_rows) * num_groups
        w_scale_at = w_scale_ptr + ((cols % n) // SCALE_ROWS) * num_groups
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if INT8 else tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_at)
            w = tl.load(w_at)
        else:
            x = tl.load(x_at, mask=depth[None, :] < k - start, other=0.0)
            w = tl.load(w_at, mask=depth[:, None] < k - start, other=0.0)
        if INT8:
            acc = tl.dot(x, w, acc)
        elif BLOCKWISE:
            product = tl.dot(x, w, max_num_imprecise_acc=BLOCK_K)
            group_scales = tl.load(x_scale_at + start // GROUP)[:, None]
            acc += product * group_scales * tl.load(w_scale_at + start // GROUP)[None, :]
        else:
            # Hopper's fp8 tensor cores add in less than float32 precision, and Triton lets
            # them run a whole K long by default (off by 3e-3 of the output at K = 14,336 on
            # an H100): each step's BLOCK_K products are summed apart, then added in float32.
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
        x_at += BLOCK_K
        w_at += BLOCK_K
    # The references' order: sum · s_x, then · s_w, then + bias, each rounded to float32.
    if BLOCKWISE:
        out = acc
    else:
        out = acc.to(tl.float32) * tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if PER_CHANNEL:
            out *= tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
        else:
            out *= tl.load(w_scale_ptr)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def gemm_tile(num_rows: int, config: dict[str, dict[str, dict[str, int]]]) -> dict[str, int]:
    """`config`'s launch table entry for a product of `num_rows` rows."""
    tables = launch_entry(config)
    if num_rows <= _SMALL_TILE_ROWS and not dispatch.batch_invariant():
        return tables["small"]
    return tables["large"]


def quantize_rows_triton(x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The Triton path of fp8_linear_reference.quantize_rows: x [M, K] as `fp8_dtype` [M, K]
    and float32 scales [M]."""
    num_rows, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    x_q = torch.empty((num_rows, k), dtype=fp8_dtype, device=x.device)
    x_scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_rows_kernel[(num_rows,)](
            x,
            x_q,
            x_scale,
            k,
            x.stride(0),
            FP8_MAX=FP8_MAX[fp8_dtype],
            MIN_NORMAL=E4M3_MIN_NORMAL[fp8_dtype],
            SUBNORMAL_STEP=E4M3_MIN_NORMAL[fp8_dtype] / 8,
            MIN_SCALE=MIN_SCALE,
            BLOCK_K=launch_entry(QUANTIZE_BLOCK),
        )
    return x_q, x_scale


def fp8_linear_triton(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """The Triton path of `fp8_linear`."""
    check_fp8_linear(x, weight, scale, bias)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be one of {X_DTYPES}, got {x.dtype}")
    num_rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    weight = weight.contiguous()
    x_q, x_scale = quantize_rows_triton(x, weight.dtype)
    launch_gemm(x_q, x_scale, weight, scale, bias, out, GEMM_CONFIG)
    return out


def launch_gemm(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out: Tensor,
    config: dict[str, dict[str, dict[str, int]]],
    block: tuple[int, int] | None = None,
) -> None:
    """`_gemm_kernel` into `out` [M, N]: (x_q Wᵀ) · x_scale · scale (+ bias), x_q [M, K] and
    the contiguous weight [N, K] both e4m3 or both int8 (int8_linear.py), with `config`'s
    tiles (shaped as `GEMM_CONFIG`); with `block` (rows, columns), x_scale [M, groups] and
    scale [⌈N / rows⌉, groups] block-wise (fp8_block_linear.py), each step cut to a group.
    An int8 product is exact, and its float32 scaling is compiled without fused
    multiply-adds, so that its output has the reference's bits."""
    num_rows, k = x_q.shape
    n = weight.shape[0]
    int8 = x_q.dtype == torch.int8
    tile = gemm_tile(num_rows, config)
    scale_rows, group = block if block is not None else (1, 1)
    block_k = tile["block_k"] if block is None else min(tile["block_k"], group)
    grid = (triton.cdiv(num_rows, tile["block_m"]), triton.cdiv(n, tile["block_n"]))
    _gemm_kernel[grid](
        x_q,
        x_scale,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        num_rows,
        n,
        k,
        x_scale.shape[1] if block is not None else 0,
        out.stride(0),
        PER_CHANNEL=scale.shape[0] > 1,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        INT8=int8,
        BLOCKWISE=block is not None,
        SCALE_ROWS=scale_rows,
        GROUP=group,
        BLOCK_M=tile["block_m"],
        BLOCK_N=tile["block_n"],
        BLOCK_K=block_k,
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
        **({"enable_fp_fusion": False} if int8 else {}),
    )


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias [N]) as [M, N] in x's dtype, W [N, K] = weight · scale being an
    FP8 W8A8 weight (e4m3fn, or e4m3fnuz on ROCm) with float32 scales [N] or [1]; x is
    quantized per row to the same format (fp8_linear_reference.py)."""
    if dispatch.use_triton():
        return fp8_linear_triton(x, weight, scale, bias)
    return fp8_linear_reference(x, weight, scale, bias)
