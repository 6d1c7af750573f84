"""Dense products y = x Wᵀ (+ b) as a Triton GEMM of one fixed tile: batch-invariant mode
(VLLM_BATCH_INVARIANT=1) on a GPU.

cuBLAS and hipBLASLt pick their kernel, tile and split of K by the product's shape, so a
row multiplied alone and the same row among 63 others can come out with other bits. Here
every product of a dtype takes one tile from the launch table, whatever its row count, and
walks K in one order with a float32 accumulator and no split: each output element is the
same sequence of tl.dot steps over the same values, wherever its row sits in the batch or
in its tile. A partial tile's extra rows re-read real ones (the indices wrap) and are never
stored, so a row's neighbours cannot reach it.

The cost is the speed of a tuned library: a decode step of a few rows fills a tile of 64
or 128 rows, and there is no split of K to spread a narrow product over the GPU. That is
why the mode is off unless asked for; bench/kernel_bandwidth.py times it beside the rest.
float32 takes a smaller tile with IEEE products (on NVIDIA TF32 is tl.dot's default).
The reference is the product in float32; on the CPU batch-invariant mode keeps its own
path (models/linear.py, tiles of one shape through torch.mm).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# One tile per activation dtype kind and platform or GPU family; each compiles without a
# register spill within its family's shared memory for sm_90a, sm_80, gfx942, gfx90a and
# gfx1100 (tests/kernels/test_gpu_compile.py, the 16-bit ones; float32 checked the same
# way by hand, bench/RESULTS.md).
_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "16bit": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
        "float32": {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2},
    },
    "rocm": {
        "16bit": {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 2},
        "float32": {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2},
    },
    # gfx1100: "rocm"'s float32 tile spilled one register.
    "rdna3": {
        "16bit": {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 2},
        "float32": {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2},
    },
    "cpu": {
        "16bit": {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 1, "num_stages": 1},
        "float32": {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 1, "num_stages": 1},
    },
}  # fmt: skip
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dense_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per (BLOCK_M rows, BLOCK_N columns); W is [N, K] row-major, its tile
    # loaded K-major, [BLOCK_K, BLOCK_N], as tl.dot's right operand.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    x_at = x_ptr + (rows % num_rows).to(tl.int64)[:, None] * stride_x + depth[None, :]
    w_at = w_ptr + (cols % n).to(tl.int64)[None, :] * stride_w + depth[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        x = tl.load(x_at, mask=depth[None, :] < k - start, other=0.0)
        w = tl.load(w_at, mask=depth[:, None] < k - start, other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    mask = (rows < num_rows)[:, None] & (cols < n)[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Refuse inputs the product cannot take, naming what is wrong."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K] with one K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_DTYPES}, got {x.dtype}, {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def dense_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) in float32, rounded to x's dtype once."""
    check_dense_linear(x, weight, bias)
    out = x.float() @ weight.float().t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def dense_linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The product of `dense_linear_reference` through the fixed-tile Triton GEMM: a row's
    bits do not depend on the rows beside it."""
    check_dense_linear(x, weight, bias)
    num_rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    ieee = x.dtype == torch.float32
    tile = launch_entry(_CONFIG)["float32" if ieee else "16bit"]
    grid = (triton.cdiv(num_rows, tile["block_m"]), triton.cdiv(n, tile["block_n"]))
    _dense_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=ieee,
        BLOCK_M=tile["block_m"],
        BLOCK_N=tile["block_n"],
        BLOCK_K=tile["block_k"],
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    return out
