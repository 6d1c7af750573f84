"""What the linear-layer kernels that split K share (gguf_linear.py, int4_group_linear.py):
storing a program's sums, and adding the splits' partial sums in a fixed order.

A product whose output has too few tiles to fill the GPU splits K into consecutive ranges:
each split's program stores its float32 partial sums in a workspace [splits, M, N]
(`store_sums`), and `sum_splits` adds them in split order, then the bias, and casts to the
output's dtype. No atomics: the result is deterministic. Without a split, `store_sums`
adds the bias and writes the output itself.
"""

from __future__ import annotations

from torch import Tensor

from aioserve.kernels.triton_compat import tl, triton

_SUM_BLOCK = 1024  # output columns per program of _sum_splits_kernel


@triton.jit
def store_sums(
    acc, row, cols, mask, split, num_rows, n, stride_out, out_ptr, partial_ptr, bias_ptr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Store a program's float32 sums `acc` for rows `row` and columns `cols` (broadcast
    against each other): as split `split`'s partial sums, or with the bias as the output."""
    if SPLIT:
        tl.store(partial_ptr + (split * num_rows + row) * n + cols, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr, bias_ptr, out_ptr, num_rows, n, num_splits, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per (row, BLOCK columns): the splits' partial sums added in split order.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(0, num_splits):
        acc += tl.load(partial_ptr + (split * num_rows + row) * n + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partial: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """out [M, N] = the sum over splits of partial [splits, M, N] (+ bias [N]), in order."""
    splits, num_rows, n = partial.shape
    _sum_splits_kernel[(num_rows, triton.cdiv(n, _SUM_BLOCK))](
        partial,
        bias if bias is not None else out,
        out,
        num_rows,
        n,
        splits,
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK=_SUM_BLOCK,
    )
