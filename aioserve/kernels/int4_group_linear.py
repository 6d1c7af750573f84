"""Linear layers on AWQ / GPTQ 4-bit weights read as stored: y = x Wᵀ (+ bias).

W [N, K] stays in the kernels' layout (int4_group_linear_reference.py describes it and
`kernel_layout` makes it once at load): `qweight` int32 [K / 8, N], eight consecutive
inputs' codes per word, `scales` [K / G, N] and uint8 `zeros` [K / G, N], one per group of
G inputs and output, and for act-order the inputs' order `perm` int32 [K]. A weight is
(q - z) * s. The kernels read the words and dequantize them in registers, never writing W
out, so a product moves about 4.2 bits a weight (G = 128) where bfloat16 moves 16.

A tile of BLOCK_K inputs lies inside one group (BLOCK_K divides G), so it has one scale
and zero per output column, loaded once. Its [BLOCK_K / 8, BLOCK_N] words are unpacked by
shifting each against the eight nibble positions, [BLOCK_K / 8, 8, BLOCK_N], which read in
row-major order is the tile's K order; with act-order the x values of a tile are gathered
through perm. A code q becomes a float as the low mantissa bits of 2²³ (an OR and a
subtraction, with the zero point folded into the subtracted constant).

Two kernels compute the product, with fp32 accumulation, as kernels/gguf_linear.py does:

- `_int4_gemv_kernel`, for a batch of up to `_GEMV_CONFIG["max_rows"]` rows: one program per
  (row of x, BLOCK_N output columns, split of K), plain multiply-adds;
- `_int4_gemm_kernel` for more rows: tiles of BLOCK_M rows × BLOCK_N columns, the
  dequantized W tile cast to x's dtype and multiplied with tl.dot; `_GEMM_CONFIG`'s "small"
  tile (16 rows) up to 16 rows, its "large" one (or "float32") beyond.

A launch with few output tiles splits K (`_SPLIT_CONFIG`): each split writes float32
partial sums, and `split_k.sum_splits` adds them in split order, then the bias. No
atomics: the result is deterministic, and the GEMV's split depends on N and K only. In
batch-invariant mode every batch takes the tiled path with the widest tile and no split.

The launch tables are fixed per platform. The GPU entries compile without a register spill
for sm_90a, sm_80, gfx942, gfx90a and gfx1100 (tests/kernels/test_gpu_compile.py); bench/RESULTS.md has their
times on an H100. The CPU entries serve Triton's interpreter only (the tests). On the CPU
the torch reference runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.int4_group_linear_reference import PACK, int4_group_linear_reference
from aioserve.kernels.split_k import store_sums, sum_splits
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import compute_units, launch_entry

# "per_unit": how many programs of the kernel one SM or CU holds at once at its register
# use; a launch of fewer tiles than that times the device's units splits K (see
# gguf_linear.py). "block_k" is the deepest tile; a smaller group size makes it shallower.
# Registers, the compiler's count in bf16 (cuda / rocm, tests/kernels/test_gpu_compile.py
# compiles every launch): GEMV 56 / 49 (9 programs an SM, 9 a CU), small tile 125 / 64 (4
# an SM, 8 a CU), large tile 184 / 100 (1 an SM, 2 a CU); act-order adds at most 4.
_GEMV_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_rows": 1, "block_n": 32, "block_k": 64, "num_warps": 4, "per_unit": 9},
    "rocm": {"max_rows": 1, "block_n": 32, "block_k": 64, "num_warps": 4, "per_unit": 9},
    "cpu": {"max_rows": 4, "block_n": 16, "block_k": 32, "num_warps": 1, "per_unit": 8},
}
_SMALL_TILE_ROWS = 16
_GEMM_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "small": {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3,
                  "per_unit": 4},
        "large": {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 3,
                  "per_unit": 1},
        "float32": {"block_m": 64, "block_n": 128, "block_k": 32, "num_warps": 8,
                    "num_stages": 2, "per_unit": 1},
    },
    "rocm": {
        "small": {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2,
                  "per_unit": 8},
        "large": {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 2,
                  "per_unit": 2},
        "float32": {"block_m": 64, "block_n": 128, "block_k": 32, "num_warps": 8,
                    "num_stages": 2, "per_unit": 2},
    },
    "cpu": {
        "small": {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 1, "num_stages": 1,
                  "per_unit": 8},
        "large": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 1, "num_stages": 1,
                  "per_unit": 8},
        "float32": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 1,
                    "num_stages": 1, "per_unit": 8},
    },
}  # fmt: skip
# Splits of K: at most `max_splits`, each at least `min_tiles` tiles of K deep.
_SPLIT_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_splits": 16, "min_tiles": 8},
    "rocm": {"max_splits": 16, "min_tiles": 8},
    "cpu": {"max_splits": 4, "min_tiles": 2},
}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dequantize_tile(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    k0,
    cols,
    col_mask,
    n,
    group_size,
    BLOCK_K: tl.constexpr,
):
    """The float32 weights [BLOCK_K / 8, 8, BLOCK_N] of inputs k0..k0 + BLOCK_K (one group)
    and columns `cols`."""
    group = k0 // group_size
    scale = tl.load(scales_ptr + group * n + cols, mask=col_mask, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + group * n + cols, mask=col_mask, other=0).to(tl.float32)
    words_at = (k0 // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.int64)[:, None] * n + cols[None, :]
    words = tl.load(qweight_ptr + words_at, mask=col_mask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    # 2**23 + q as a float, less 2**23 + z: q - z exactly.
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True)
    offset = (zero + 8388608.0)[None, None, :]
    return (q - offset) * scale[None, None, :]


@triton.jit
def _input_index(perm_ptr, k, HAS_PERM: tl.constexpr):
    """The inputs of x at tile positions `k`: perm[k] with act-order, else k."""
    if HAS_PERM:
        return tl.load(perm_ptr + k)
    return k


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, partial_ptr,
    num_rows, n, k, group_size, k_per_split, stride_x, stride_out,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program per (row of x, BLOCK_N columns, split of K); products accumulate
    # element-wise and are summed once, at the end.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    col_mask = cols < n
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, k)
    depth = tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK_K // 8, 8, BLOCK_N], dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        w = _dequantize_tile(
            qweight_ptr, scales_ptr, zeros_ptr, k0, cols, col_mask, n, group_size, BLOCK_K
        )
        x = tl.load(x_row + _input_index(perm_ptr, k0 + depth, HAS_PERM)).to(tl.float32)
        acc += w * x[:, :, None]
    result = tl.sum(tl.sum(acc, axis=0), axis=0)
    store_sums(
        result, row, cols, col_mask, split, num_rows, n, stride_out,
        out_ptr, partial_ptr, bias_ptr, HAS_BIAS, SPLIT,
    )  # fmt: skip


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, partial_ptr,
    num_rows, n, k, group_size, k_per_split, stride_x, stride_out,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program per (BLOCK_M rows, BLOCK_N columns, split of K); the row tiles of one
    # column tile are neighbours in the grid, so they find its words in L2.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < num_rows
    col_mask = cols < n
    start = split * k_per_split
    end = tl.minimum(start + k_per_split, k)
    depth = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        w = _dequantize_tile(
            qweight_ptr, scales_ptr, zeros_ptr, k0, cols, col_mask, n, group_size, BLOCK_K
        )
        w = tl.reshape(w, [BLOCK_K, BLOCK_N]).to(x_ptr.dtype.element_ty)
        inputs = _input_index(perm_ptr, k0 + depth, HAS_PERM)
        x = tl.load(x_rows + inputs[None, :], mask=row_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    store_sums(
        acc, rows.to(tl.int64)[:, None], cols[None, :], row_mask[:, None] & col_mask[None, :],
        split, num_rows, n, stride_out, out_ptr, partial_ptr, bias_ptr, HAS_BIAS, SPLIT,
    )  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """How one product is launched."""

    gemv: bool
    block_m: int  # 1 for the GEMV
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int
    k_per_split: int


def tile_depth(wanted: int, group_size: int) -> int:
    """The deepest tile of at most `wanted` inputs inside a group of `group_size` (a
    multiple of 16): the largest power of two dividing both."""
    depth = wanted
    while group_size % depth:
        depth //= 2
    return depth


def _split(tiles: int, k: int, depth: int, config: dict[str, int]) -> tuple[int, int]:
    """(splits, inputs per split) of a launch of `tiles` output tiles over K = `k` walked
    `depth` at a time; a split covers whole tiles, the last may be short."""
    limits = launch_entry(_SPLIT_CONFIG)
    steps = k // depth
    wanted = min(limits["max_splits"], triton.cdiv(config["per_unit"] * compute_units(), tiles))
    splits = max(1, min(wanted, steps // limits["min_tiles"]))
    per_split = triton.cdiv(steps, splits) * depth
    return triton.cdiv(k, per_split), per_split


def _plan(num_rows: int, n: int, k: int, group_size: int, dtype: torch.dtype) -> _Plan:
    invariant = dispatch.batch_invariant()
    gemv = launch_entry(_GEMV_CONFIG)
    if num_rows <= gemv["max_rows"] and not invariant:
        depth = tile_depth(gemv["block_k"], group_size)
        splits, per_split = _split(triton.cdiv(n, gemv["block_n"]), k, depth, gemv)
        return _Plan(True, 1, gemv["block_n"], depth, gemv["num_warps"], 1, splits, per_split)
    if num_rows <= _SMALL_TILE_ROWS and not invariant:
        tile = launch_entry(_GEMM_CONFIG)["small"]
    else:
        tile = launch_entry(_GEMM_CONFIG)["float32" if dtype == torch.float32 else "large"]
    depth = tile_depth(tile["block_k"], group_size)
    if invariant:
        splits, per_split = 1, k
    else:
        tiles = triton.cdiv(num_rows, tile["block_m"]) * triton.cdiv(n, tile["block_n"])
        splits, per_split = _split(tiles, k, depth, tile)
    return _Plan(
        False,
        tile["block_m"],
        tile["block_n"],
        depth,
        tile["num_warps"],
        tile["num_stages"],
        splits,
        per_split,
    )


def _check(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    perm: Tensor | None,
    group_size: int,
    bias: Tensor | None,
) -> None:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [M, K] in one of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    k, n = x.shape[1], qweight.shape[1]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k // PACK, n) or k % PACK:
        raise ValueError(
            f"qweight for K = {k} must be int32 [{k // PACK}, N], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    if group_size % 16 or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 16 dividing K = {k}")
    groups = (k // group_size, n)
    if tuple(scales.shape) != groups or tuple(zeros.shape) != groups or zeros.dtype != torch.uint8:
        raise ValueError(
            f"scales and uint8 zeros must be {list(groups)}, got {scales.dtype} "
            f"{tuple(scales.shape)} and {zeros.dtype} {tuple(zeros.shape)}"
        )
    if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm must be int32 [{k}], got {perm.dtype} {tuple(perm.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def int4_group_linear_triton(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    perm: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
) -> Tensor:
    """The Triton path of `int4_group_linear`."""
    _check(x, qweight, scales, zeros, perm, group_size, bias)
    num_rows, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    plan = _plan(num_rows, n, k, group_size, x.dtype)
    split = plan.splits > 1
    partial = (
        torch.empty((plan.splits, num_rows, n), dtype=torch.float32, device=x.device)
        if split
        else out
    )
    arguments = (
        x,
        qweight.contiguous(),
        scales.contiguous(),
        zeros.contiguous(),
        perm if perm is not None else qweight,
        bias if bias is not None else out,
        out,
        partial,
        num_rows,
        n,
        k,
        group_size,
        plan.k_per_split,
        x.stride(0),
        out.stride(0),
    )
    constants = dict(
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    column_tiles = triton.cdiv(n, plan.block_n)
    if plan.gemv:
        _int4_gemv_kernel[(num_rows, column_tiles, plan.splits)](*arguments, **constants)
    else:
        row_tiles = triton.cdiv(num_rows, plan.block_m)
        _int4_gemm_kernel[(row_tiles, column_tiles, plan.splits)](
            *arguments, BLOCK_M=plan.block_m, **constants
        )
    if split:
        sum_splits(partial, bias, out)
    return out


def int4_group_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    perm: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias [N]) as [M, N] in x's dtype, W [N, K] an AWQ / GPTQ 4-bit
    weight in the kernels' layout (int4_group_linear_reference.kernel_layout).

    x is float16, bfloat16 or float32; the sums are float32, the bias added in float32
    before the cast.
    """
    if dispatch.use_triton():
        return int4_group_linear_triton(x, qweight, scales, zeros, perm, group_size, bias)
    return int4_group_linear_reference(x, qweight, scales, zeros, perm, group_size, bias)
