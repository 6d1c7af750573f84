"""Multi-LoRA products in torch: the CPU's path and the oracle of the Triton kernels
(lora.py).

A LoRA-capable layer y = x Wᵀ (a stacked one such as qkv_proj = [q|k|v] or gate_up_proj =
[gate|up] has one "slice" per part) adds, for each token with an adapter,
y += (x Aᵀ) Bᵀ of that token's adapter. The layer keeps its adapters' weights stacked in
fixed slots, zero-padded to the largest rank R:

- `a` [S, n_slices · R, in_features]: slot s's rows [i·R, (i+1)·R) are slice i's lora_A;
- `b` [S, out_features, R]: slot s's row j is the lora_B row of output column j (for the
  slice j belongs to), already multiplied by the adapter's scaling;
- `slice_bounds` (0, ..., out_features), n_slices + 1 ints: slice i reads xa columns
  [i·R, (i+1)·R) and writes output columns [slice_bounds[i], slice_bounds[i+1]).

Padding rows of A and columns of B are zeros, so they add nothing. The step's tokens come
grouped by slot (lora.py's `LoRATokenGroups`, built once a step for every layer): here the
grouped tokens are gathered once (index_select), each group takes one matmul for the
shrink xa = x_g A_sᵀ (xa rounded to the operands' dtype, as torch's matmul gives it) and
one a slice for the expand, and one index_add_ adds every product back (an index_add_ into
a slice's columns, a strided view, ran ~3x slower); when the whole step uses one slot,
plain row slices instead, no gather. No Python loop over tokens. Unlike the Triton
kernels', a token's bits may depend on the size of its group here (torch's CPU GEMM picks
its blocking by shape). a and b may be float32 beside a 16-bit x and out (the CPU's slots,
runner/lora_slots.py): torch's small bfloat16 products on a CPU cost ~15 us each where
float32's take ~4 (a one-row product of SmolLM2's qkv slot), and those are most of a LoRA
layer's time at one stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from aioserve.kernels.lora import LoRATokenGroups

LORA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_lora(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    slice_bounds: tuple[int, ...],
    float32_weights: bool = False,
) -> int:
    """Raise ValueError when out, x, the stacked adapter weights and the slice bounds do not
    fit together; return R, the padded rank. With `float32_weights`, a and b may also be
    float32 beside a 16-bit out and x."""
    if x.dim() != 2 or out.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            "want out [T, out_features], x [T, in_features], a [S, n_slices * R, in_features] "
            f"and b [S, out_features, R], got {tuple(out.shape)}, {tuple(x.shape)}, "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    weights_dtype = torch.float32 if float32_weights and a.dtype == torch.float32 else x.dtype
    if (
        not (out.dtype == x.dtype and a.dtype == b.dtype == weights_dtype)
        or x.dtype not in LORA_DTYPES
    ):
        raise ValueError(
            f"out, x, a and b must share one dtype of {LORA_DTYPES}, got "
            f"{out.dtype}, {x.dtype}, {a.dtype} and {b.dtype}"
        )
    num_slices = len(slice_bounds) - 1
    rank = b.shape[2]
    if num_slices < 1 or slice_bounds[0] != 0 or slice_bounds[-1] != out.shape[1]:
        raise ValueError(
            f"slice_bounds must run from 0 to out_features {out.shape[1]}, got {slice_bounds}"
        )
    if any(lo > hi for lo, hi in zip(slice_bounds[:-1], slice_bounds[1:], strict=True)):
        raise ValueError(f"slice_bounds must not decrease, got {slice_bounds}")
    if x.shape[0] != out.shape[0]:
        raise ValueError(f"x and out need as many rows, got {x.shape[0]} and {out.shape[0]}")
    if a.shape[2] != x.shape[1] or a.shape[1] != num_slices * rank:
        raise ValueError(
            f"a must be [S, {num_slices} * R, {x.shape[1]}] for b's R {rank}, got {tuple(a.shape)}"
        )
    if b.shape[0] != a.shape[0] or b.shape[1] != out.shape[1]:
        raise ValueError(
            f"b must be [{a.shape[0]}, {out.shape[1]}, R] as a and out, got {tuple(b.shape)}"
        )
    return rank


def add_lora_reference(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    slice_bounds: tuple[int, ...],
    groups: LoRATokenGroups,
) -> None:
    """out[t] += (x[t] A_sᵀ) B_sᵀ, slice by slice, for each token t of each group (slot s),
    in place; tokens in no group are left alone. With a and b in float32 beside a 16-bit x
    and out, the products are float32, rounded once into out."""
    rank = check_lora(out, x, a, b, slice_bounds, float32_weights=True)
    if a.dtype != x.dtype:
        x = x.to(a.dtype)
    bounds = list(zip(slice_bounds[:-1], slice_bounds[1:], strict=True))
    if groups.whole_batch_slot is not None:
        # token_order is 0 .. N-1: rows [0, N) of x and out, no gathers.
        num_rows = groups.group_starts_host[-1]
        slot = groups.whole_batch_slot
        xa = x[:num_rows] @ a[slot].t()
        for i, (lo, hi) in enumerate(bounds):
            if hi <= lo:
                continue
            if out.dtype == a.dtype:
                out[:num_rows, lo:hi].addmm_(xa[:, i * rank : (i + 1) * rank], b[slot, lo:hi].t())
            else:
                out[:num_rows, lo:hi] += xa[:, i * rank : (i + 1) * rank] @ b[slot, lo:hi].t()
        return
    # One gather of every grouped token, each group's products into its rows of one
    # buffer (a group's rows are contiguous there), one scatter-add back.
    starts = groups.group_starts_host
    x_grouped = x.index_select(0, groups.token_order)
    products = torch.empty((starts[-1], out.shape[1]), dtype=a.dtype, device=out.device)
    for g, slot in enumerate(groups.group_slots_host):
        rows = slice(starts[g], starts[g + 1])
        xa = x_grouped[rows] @ a[slot].t()
        for i, (lo, hi) in enumerate(bounds):
            products[rows, lo:hi] = xa[:, i * rank : (i + 1) * rank] @ b[slot, lo:hi].t()
    out.index_add_(0, groups.token_order, products.to(out.dtype))
