"""Linear layers on GGUF quantized weights read as stored: y = x Wᵀ (+ bias), for Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.

The weight W [N, K] stays in the GGUF file's layout (gguf_linear_reference.py describes
each type's): `blocks` uint8 [N, K / block weights * block bytes], rows contiguous. The
kernels read the blocks and dequantize them in registers (gguf_dequant.py), never writing W
out, so a product moves the file's 4.5 (Q4_0) to 8.5 (Q8_0) bits a weight where a bfloat16
W would move 16: a decode step is bound by exactly those bytes.

Every type goes through the same two kernels, its dequantization a compile-time branch
(QTYPE): each reads a row as groups of 32 weights (a block, or a k-quant super-block's
sub-block) and a group two weights at a time, j and j + 16, the pair a Q4_0 byte holds.
The kernels compute the product with fp32 accumulation:

- `_gemv_kernel`, for a batch of up to `_GEMV_CONFIG["max_rows"]` rows (decode at one
  stream): one program per (row of x, BLOCK_N output columns, split of K), walking K
  BLOCK_G groups of 32 weights at a time with plain multiply-adds;
- `_gemm_kernel` for more rows: tiles of BLOCK_M rows × BLOCK_N columns, the dequantized
  W tile cast to x's dtype and multiplied with tl.dot. Each step makes two dots, the
  weights j of its groups against x's columns 32 g + j and the weights j + 16 against
  columns 32 g + j + 16, and no tile is shuffled back into K's order. The tile is
  `_GEMM_CONFIG`'s "small" one (16 rows) for up to 16 rows, its "large" one (128 rows on
  a GPU; float32 has its own) beyond.

A weight with few output columns leaves most of the GPU idle, so both kernels may split K
into `splits` consecutive ranges (`_SPLIT_CONFIG`): each split writes its float32 partial
sums to a workspace and `split_k.sum_splits` adds them in split order, then the bias. No
atomics: the result is deterministic. The GEMV's split depends on N and K only, so a row's
result does not depend on the batch it came in; a batch that takes the tiled path gets
other bits (another tile, another order). In batch-invariant mode
(`dispatch.batch_invariant`) every batch takes the tiled path with the widest tile and no
split, which keeps a row's bits whatever shares its batch, at some cost to small batches.

The launch tables are fixed per platform and GPU family (platform.launch_entry), never
tuned at run time, and shared by every type. The GPU entries compile without a register
spill for sm_90a, sm_80, gfx942, gfx90a and gfx1100 (tests/kernels/test_gpu_compile.py) and are sized from the arithmetic in their comments,
made for the 4-bit types; the others decode more per weight (cuda GEMV: Q5_1 95 registers,
the k-quants 96–128, so 4 programs an SM where the table counts 7). Their times on an
H100 are in bench/RESULTS.md. The CPU entries serve Triton's interpreter only (the tests):
small tiles, splits at small shapes. On the CPU the torch reference runs
(gguf_linear_reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.gguf_dequant import dequantize_pair
from aioserve.kernels.gguf_linear_reference import (
    BLOCK_LAYOUT,
    GGUF_TYPES,
    GROUP_SIZE,
    gguf_linear_reference,
)
from aioserve.kernels.split_k import store_sums, sum_splits
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import compute_units, launch_entry

# The launch tables, fixed per platform and family. "per_unit" is how many programs of the
# kernel one SM (NVIDIA) or CU (AMD) holds at once at the kernel's register use (sm_90a:
# 65,536 registers an SM; gfx942: 512 VGPRs a SIMD lane, 4 SIMDs a CU): a launch of fewer
# output tiles than that times the device's units (`platform.compute_units`: 132 on an
# H100 SXM, 114 on the PCIe card, 304 on an MI300X) splits K (`_split`). Registers below
# are the compiler's count in bf16 (tests/kernels/test_gpu_compile.py compiles every
# launch).

# The GEMV: the most rows it takes, output columns and groups of 32 weights per step,
# warps. A row decodes every weight again, about five instructions a weight, which at one
# row already keeps an H100 SM's ALUs ~2/3 busy at full memory speed (an MI300X CU fully);
# from two rows on, the tiled path, which decodes a tile once for all its rows, is
# expected to be faster. Few columns by many blocks: a thread's bytes then come from few
# rows, so it holds few addresses (cuda: 72 registers, 7 programs an SM; 16 columns by 8
# blocks took 139; rocm: 54 VGPRs, 8 programs a CU).
_GEMV_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_rows": 1, "block_n": 4, "block_g": 32, "num_warps": 4, "per_unit": 7},
    "rocm": {"max_rows": 1, "block_n": 8, "block_g": 16, "num_warps": 4, "per_unit": 8},
    "cpu": {"max_rows": 4, "block_n": 16, "block_g": 2, "num_warps": 1, "per_unit": 8},
}
# The tiled product: the "small" tile for batches of up to _SMALL_TILE_ROWS rows (16 is
# tl.dot's least), the "large" one for the rest, "float32" instead of "large" for float32
# x (on NVIDIA its tl.dot runs on the FMA units, operands in registers: the large tile
# spills there). The large tile is 128 rows deep because decoding a W tile costs about as
# much as multiplying it by 64 rows (~5 ALU instructions a weight against 2 * 64
# tensor-core FLOPs). Registers, cuda / rocm: small 120 / 64 (4 programs an SM, 8 a CU),
# large 180 / 102 (1 an SM, 2 a CU), float32 174 / 119.
_SMALL_TILE_ROWS = 16
_GEMM_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "small": {"block_m": 16, "block_n": 64, "block_g": 2, "num_warps": 4, "num_stages": 2,
                  "per_unit": 4},
        "large": {"block_m": 128, "block_n": 128, "block_g": 1, "num_warps": 8, "num_stages": 2,
                  "per_unit": 1},
        "float32": {"block_m": 64, "block_n": 128, "block_g": 1, "num_warps": 8,
                    "num_stages": 2, "per_unit": 1},
    },
    "rocm": {
        "small": {"block_m": 16, "block_n": 64, "block_g": 2, "num_warps": 4, "num_stages": 2,
                  "per_unit": 8},
        "large": {"block_m": 128, "block_n": 128, "block_g": 1, "num_warps": 8, "num_stages": 2,
                  "per_unit": 2},
        "float32": {"block_m": 128, "block_n": 128, "block_g": 1, "num_warps": 8,
                    "num_stages": 2, "per_unit": 2},
    },
    # sm_80: "cuda"'s large tile spilled 32 bytes (Q5_0 ... Q6_K with a split of K), and so
    # did 128 x 64 (8 bytes, Q5_K) and 16 warps.
    "ampere": {
        "small": {"block_m": 16, "block_n": 64, "block_g": 2, "num_warps": 4, "num_stages": 2,
                  "per_unit": 4},
        "large": {"block_m": 64, "block_n": 128, "block_g": 1, "num_warps": 8, "num_stages": 2,
                  "per_unit": 1},
        "float32": {"block_m": 64, "block_n": 128, "block_g": 1, "num_warps": 8,
                    "num_stages": 2, "per_unit": 1},
    },
    # gfx1100 (wave32): "rocm"'s tiles spilled 10-64 bytes in the k-quants and Q8_0, and so
    # did 16 x 32 and 8 warps at 16 rows.
    "rdna3": {
        "small": {"block_m": 16, "block_n": 64, "block_g": 1, "num_warps": 4, "num_stages": 2,
                  "per_unit": 8},
        "large": {"block_m": 128, "block_n": 64, "block_g": 1, "num_warps": 16, "num_stages": 2,
                  "per_unit": 2},
        "float32": {"block_m": 64, "block_n": 64, "block_g": 1, "num_warps": 8,
                    "num_stages": 2, "per_unit": 2},
    },
    "cpu": {
        "small": {"block_m": 16, "block_n": 16, "block_g": 2, "num_warps": 1, "num_stages": 1,
                  "per_unit": 8},
        "large": {"block_m": 32, "block_n": 32, "block_g": 2, "num_warps": 1, "num_stages": 1,
                  "per_unit": 8},
        "float32": {"block_m": 32, "block_n": 32, "block_g": 2, "num_warps": 1,
                    "num_stages": 1, "per_unit": 8},
    },
}  # fmt: skip
# Splits of K: at most `max_splits`, each walking at least `min_groups` groups of 32
# weights, so that a split's partial sums (8 bytes a row and column, written and read
# back) stay small beside its weights (at least 288 bytes a column in Q4_0).
_SPLIT_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_splits": 16, "min_groups": 16},
    "rocm": {"max_splits": 16, "min_groups": 16},
    "cpu": {"max_splits": 4, "min_groups": 2},
}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    blocks_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    num_rows,
    n,
    groups_per_row,
    groups_per_split,
    row_bytes,
    stride_x,
    stride_out,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # One program per (row of x, BLOCK_N output columns, split of K). The tile of a step
    # is [BLOCK_N columns, BLOCK_G blocks, 16 bytes]; products accumulate element-wise and
    # are summed once, at the end.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    col_mask = cols < n
    row_at = blocks_ptr + cols.to(tl.int64) * row_bytes
    start = split * groups_per_split
    end = tl.minimum(start + groups_per_split, groups_per_row)
    byte = tl.arange(0, 16)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_G, 16], dtype=tl.float32)
    for group in range(start, end, BLOCK_G):
        groups = group + tl.arange(0, BLOCK_G)
        group_mask = groups < end
        low, high = dequantize_pair(
            row_at[:, None],
            groups[None, :],
            col_mask[:, None] & group_mask[None, :],
            byte[None, None, :],
            2,
            QTYPE,
            BLOCK_BYTES,
        )
        x_at = x_row + groups[:, None] * 32 + byte[None, :]
        x_low = tl.load(x_at, mask=group_mask[:, None], other=0.0).to(tl.float32)
        x_high = tl.load(x_at + 16, mask=group_mask[:, None], other=0.0).to(tl.float32)
        acc += low * x_low[None, :, :] + high * x_high[None, :, :]
    result = tl.sum(tl.sum(acc, axis=2), axis=1)
    store_sums(
        result, row, cols, col_mask, split, num_rows, n, stride_out,
        out_ptr, partial_ptr, bias_ptr, HAS_BIAS, SPLIT,
    )  # fmt: skip


@triton.jit
def _gemm_kernel(
    x_ptr,
    blocks_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    num_rows,
    n,
    groups_per_row,
    groups_per_split,
    row_bytes,
    stride_x,
    stride_out,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # One program per (BLOCK_M rows, BLOCK_N columns, split of K); the row tiles of one
    # column tile are neighbours in the grid, so they find its weights in L2. Position i
    # of a step's K tile (BLOCK_G * 16 deep) is pair i % 16 of group i // 16: the first
    # weights' tile meets x's column 32 * (i // 16) + i % 16, the second's that + 16.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < num_rows
    col_mask = cols < n
    row_at = blocks_ptr + cols.to(tl.int64) * row_bytes
    start = split * groups_per_split
    end = tl.minimum(start + groups_per_split, groups_per_row)
    depth = tl.arange(0, BLOCK_G * 16)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for group in range(start, end, BLOCK_G):
        groups = group + tl.arange(0, BLOCK_G)
        group_mask = groups < end
        low, high = dequantize_pair(
            row_at[None, :],
            groups[:, None],
            group_mask[:, None] & col_mask[None, :],
            tl.arange(0, 16)[None, :, None],
            1,
            QTYPE,
            BLOCK_BYTES,
        )
        low = tl.reshape(low, [BLOCK_G * 16, BLOCK_N]).to(x_ptr.dtype.element_ty)
        high = tl.reshape(high, [BLOCK_G * 16, BLOCK_N]).to(x_ptr.dtype.element_ty)
        depth_group = group + depth // 16
        x_at = x_rows + (depth_group * 32 + depth % 16)[None, :]
        x_mask = row_mask[:, None] & (depth_group < end)[None, :]
        x_low = tl.load(x_at, mask=x_mask, other=0.0)
        x_high = tl.load(x_at + 16, mask=x_mask, other=0.0)
        acc = tl.dot(x_low, low, acc, input_precision="ieee")
        acc = tl.dot(x_high, high, acc, input_precision="ieee")
    store_sums(
        acc, rows.to(tl.int64)[:, None], cols[None, :], row_mask[:, None] & col_mask[None, :],
        split, num_rows, n, stride_out, out_ptr, partial_ptr, bias_ptr, HAS_BIAS, SPLIT,
    )  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """How one product is launched: which kernel, its tile and launch options, the split
    of K."""

    gemv: bool
    block_m: int  # 1 for the GEMV: a row per program
    block_n: int
    block_g: int
    num_warps: int
    num_stages: int
    splits: int
    groups_per_split: int


def _split(tiles: int, groups: int, config: dict[str, int]) -> tuple[int, int]:
    """(splits, groups per split) of a launch of `tiles` output tiles over `groups` groups
    of 32 weights with the kernel `config`; a split covers whole steps, the last may be
    short."""
    limits = launch_entry(_SPLIT_CONFIG)
    wanted = min(limits["max_splits"], triton.cdiv(config["per_unit"] * compute_units(), tiles))
    splits = max(1, min(wanted, groups // limits["min_groups"]))
    step = config["block_g"]
    per_split = max(1, triton.cdiv(triton.cdiv(groups, splits), step)) * step
    return max(1, triton.cdiv(groups, per_split)), per_split


def _plan(num_rows: int, n: int, groups: int, dtype: torch.dtype) -> _Plan:
    """The launch of a product of `num_rows` rows of x in `dtype`, `n` output columns and
    `groups` groups of 32 weights along K."""
    invariant = dispatch.batch_invariant()
    gemv = launch_entry(_GEMV_CONFIG)
    if num_rows <= gemv["max_rows"] and not invariant:
        # A single row's tiles set the split, whatever the batch (see the docstring).
        splits, per_split = _split(triton.cdiv(n, gemv["block_n"]), groups, gemv)
        return _Plan(
            True, 1, gemv["block_n"], gemv["block_g"], gemv["num_warps"], 1, splits, per_split
        )
    if num_rows <= _SMALL_TILE_ROWS and not invariant:
        tile = launch_entry(_GEMM_CONFIG)["small"]
    else:
        tile = launch_entry(_GEMM_CONFIG)["float32" if dtype == torch.float32 else "large"]
    if invariant:
        splits, per_split = 1, max(groups, 1)
    else:
        output_tiles = triton.cdiv(num_rows, tile["block_m"]) * triton.cdiv(n, tile["block_n"])
        splits, per_split = _split(output_tiles, groups, tile)
    return _Plan(
        False,
        tile["block_m"],
        tile["block_n"],
        tile["block_g"],
        tile["num_warps"],
        tile["num_stages"],
        splits,
        per_split,
    )


def _check(x: Tensor, blocks: Tensor, qtype: str, bias: Tensor | None) -> None:
    if qtype not in BLOCK_LAYOUT:
        raise ValueError(f"not a supported GGUF type: {qtype!r}; expected one of {GGUF_TYPES}")
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [M, K] in one of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    block_weights, block_bytes = BLOCK_LAYOUT[qtype]
    expected = k // block_weights * block_bytes
    if (
        k % block_weights
        or blocks.dtype != torch.uint8
        or blocks.dim() != 2
        or blocks.shape[1] != expected
    ):
        raise ValueError(
            f"{qtype} blocks for K = {k} must be uint8 [N, {expected}] (K a multiple of "
            f"{block_weights}), got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if bias is not None and bias.shape != (blocks.shape[0],):
        raise ValueError(f"bias must be [{blocks.shape[0]}], got {tuple(bias.shape)}")


def gguf_linear_triton(x: Tensor, blocks: Tensor, qtype: str, bias: Tensor | None = None) -> Tensor:
    """The Triton path of `gguf_linear`."""
    _check(x, blocks, qtype, bias)
    num_rows, k = x.shape
    n = blocks.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    blocks = blocks.contiguous()
    if blocks.data_ptr() % 2:  # the kernels read each block's d as an aligned float16
        blocks = blocks.clone()
    plan = _plan(num_rows, n, k // GROUP_SIZE, x.dtype)
    split = plan.splits > 1
    partial = (
        torch.empty((plan.splits, num_rows, n), dtype=torch.float32, device=x.device)
        if split
        else out
    )
    arguments = (
        x,
        blocks,
        bias if bias is not None else out,
        out,
        partial,
        num_rows,
        n,
        k // GROUP_SIZE,
        plan.groups_per_split,
        blocks.stride(0),
        x.stride(0),
        out.stride(0),
    )
    constants = dict(
        QTYPE=qtype,
        BLOCK_BYTES=BLOCK_LAYOUT[qtype][1],
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_N=plan.block_n,
        BLOCK_G=plan.block_g,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    column_tiles = triton.cdiv(n, plan.block_n)
    if plan.gemv:
        _gemv_kernel[(num_rows, column_tiles, plan.splits)](*arguments, **constants)
    else:
        row_tiles = triton.cdiv(num_rows, plan.block_m)
        _gemm_kernel[(row_tiles, column_tiles, plan.splits)](
            *arguments, BLOCK_M=plan.block_m, **constants
        )
    if split:
        sum_splits(partial, bias, out)
    return out


def gguf_linear(x: Tensor, blocks: Tensor, qtype: str, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias [N]) as [M, N] in x's dtype, W [N, K] being the GGUF `qtype`
    (one of GGUF_TYPES: "q4_0", ..., "q6_k") weight stored in `blocks`, uint8
    [N, K / block weights * block bytes].

    x is float16, bfloat16 or float32; the sums are float32, the bias added in float32
    before the cast.
    """
    if dispatch.use_triton():
        return gguf_linear_triton(x, blocks, qtype, bias)
    return gguf_linear_reference(x, blocks, qtype, bias)
