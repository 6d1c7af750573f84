"""Multi-LoRA on a GPU: the batched shrink and expand of the step's tokens, grouped by
adapter slot (punica's SGMV scheme), and the grouping itself.

lora_reference.py states the layout: per layer, the adapters' lora_A stacked as
a [S, n_slices · R, in_features] and their scaled lora_B as b [S, out_features, R], in
slots s < S, zero-padded to the largest rank R; a stacked layer (qkv_proj, gate_up_proj)
has its slices' output columns at `slice_bounds`. A step mixes tokens of several adapters
and tokens of none; `lora_token_groups` sorts the tokens that have one by slot, once a step
for every layer, so that a kernel program meets one adapter's weights only and reads them
for a whole tile of its tokens.

Two launches a layer:

- `_lora_shrink_kernel`: xa [N, n_slices · R] = x[token_order] a[slot]ᵀ, one program a
  (tile of rank columns, tile of a group's tokens, group), K walked in BLOCK_K steps;
- `_lora_expand_kernel`: out[token, slice columns] += xa[:, slice's R] b[slot, columns]ᵀ,
  one program a (slice and tile of its columns, tile of a group's tokens, group), the
  output tile read, added to in float32 and rounded once.

Both gather their tokens through token_order (rows of a tile past its group's end are
masked), multiply with tl.dot in float32 (IEEE products for float32 operands) and keep xa
in the operands' dtype, as the reference does. Tiles come from fixed per-family tables
(the expand's rank step also from R), never from the batch, and no sum is split, so a
token's result is the same bits whatever else its step holds. The grid spans the largest
group; programs of a smaller group's missing tiles return at once. Each token is in one
group and each program writes its own columns, so no atomics. On the CPU `add_lora` runs
the reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.lora_reference import add_lora_reference, check_lora
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry


@dataclass(frozen=True, eq=False)
class LoRATokenGroups:
    """The step's tokens that have an adapter, grouped by slot: built once a step on the
    host (`lora_token_groups`), shared by every LoRA layer."""

    # int64 [N] on the device: the tokens with an adapter, sorted by slot (stable).
    token_order: Tensor
    # int32 [G + 1] on the device: group g is token_order[group_starts[g]:group_starts[g+1]].
    group_starts: Tensor
    # int32 [G] on the device: group g's slot (ascending).
    group_slots: Tensor
    # The same on the host, so that the reference needs no device sync.
    group_slots_host: tuple[int, ...]
    group_starts_host: tuple[int, ...]
    # The most tokens of one group (the Triton grid's token tiles).
    max_group_tokens: int
    # The slot when every token of the step has that one (token_order is then 0 .. T-1).
    whole_batch_slot: int | None


def lora_token_groups(
    token_slots: Sequence[int] | Tensor, device: torch.device | str
) -> LoRATokenGroups | None:
    """Group tokens by adapter slot: token_slots[t] is token t's slot, -1 for none (a
    device tensor is read back to the host first: a sync). None when no token has an
    adapter."""
    if isinstance(token_slots, Tensor):
        slots = token_slots.detach().to("cpu", torch.int64).reshape(-1)
    else:
        slots = torch.as_tensor(token_slots, dtype=torch.int64).reshape(-1)
    with_adapter = torch.nonzero(slots >= 0).flatten()
    if with_adapter.numel() == 0:
        return None
    sorted_slots, order = torch.sort(slots[with_adapter], stable=True)
    token_order = with_adapter[order]
    group_slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slots_host = tuple(group_slots.tolist())
    counts_host = counts.tolist()
    starts_host = (0, *itertools.accumulate(counts_host))
    whole = slots_host[0] if len(slots_host) == 1 and starts_host[-1] == slots.numel() else None
    return LoRATokenGroups(
        token_order=token_order.to(device),
        group_starts=torch.tensor(starts_host, dtype=torch.int32, device=device),
        group_slots=torch.tensor(slots_host, dtype=torch.int32, device=device),
        group_slots_host=slots_host,
        group_starts_host=starts_host,
        max_group_tokens=max(counts_host),
        whole_batch_slot=whole,
    )


# Tiles of the shrink: BLOCK_M tokens × BLOCK_R rank columns, K in BLOCK_K steps; and of
# the expand: BLOCK_M tokens × BLOCK_N output columns, the rank in steps of up to block_r
# (R rounded up to a power of two, at least 16). One entry per platform and dtype kind;
# each compiles without a register spill and within the family's shared memory on sm_90a,
# sm_80, gfx942, gfx90a and gfx1100 at SmolLM2's and Llama-3-8B's layers, ranks 16 and 64
# (tests/kernels/test_gpu_compile.py for the 16-bit ones, float32 checked the same way by
# hand). Tried and spilled: a shrink K step of 128 (96 bytes on sm_90a, 44 on sm_80), the
# expand's rank step of 64 (208 on sm_90a, 388 on sm_80), of 32 on 4 warps on sm_80 (84);
# in float32 the 16-bit tiles (up to 48 bytes on sm_90a, 332 on sm_80, 183 registers on
# gfx1100). Narrow rank tiles give a decode step's shrink more programs (its K is never
# split). Not yet timed on a GPU. The "cpu" rows are the interpreter's (fast tests).
_FLOAT32_SHRINK = {"block_m": 64, "block_r": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
_FLOAT32_EXPAND = {"block_m": 64, "block_n": 32, "block_r": 16, "num_warps": 4, "num_stages": 2}
_CPU_SHRINK = {"block_m": 16, "block_r": 16, "block_k": 32, "num_warps": 1, "num_stages": 1}
_CPU_EXPAND = {"block_m": 16, "block_n": 16, "block_r": 16, "num_warps": 1, "num_stages": 1}
_SHRINK_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "16bit": {"block_m": 64, "block_r": 16, "block_k": 64, "num_warps": 4, "num_stages": 3},
        "float32": _FLOAT32_SHRINK,
    },
    "rocm": {
        "16bit": {"block_m": 64, "block_r": 16, "block_k": 64, "num_warps": 4, "num_stages": 2},
        "float32": _FLOAT32_SHRINK,
    },
    "cpu": {"16bit": _CPU_SHRINK, "float32": _CPU_SHRINK},
}
_EXPAND_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "16bit": {"block_m": 64, "block_n": 64, "block_r": 32, "num_warps": 8, "num_stages": 2},
        "float32": _FLOAT32_EXPAND,
    },
    "rocm": {
        "16bit": {"block_m": 64, "block_n": 64, "block_r": 32, "num_warps": 4, "num_stages": 1},
        "float32": _FLOAT32_EXPAND,
    },
    "cpu": {"16bit": _CPU_EXPAND, "float32": _CPU_EXPAND},
}  # fmt: skip
# tl.dot needs at least 16 rows, columns and reduction depth on every GPU target.
_MIN_DOT = 16
# Slices of one layer the expand takes: q, k and v.
MAX_SLICES = 3


@triton.jit
def _group_tile(group_slots_ptr, token_order_ptr, group, first, end, BLOCK_M: tl.constexpr):
    """Tokens [first, first + BLOCK_M) of group's rows of token_order (those from `end` on
    masked): the rows, their mask, the tokens, the group's slot."""
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(token_order_ptr + rows, mask=row_mask, other=0)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    return rows, row_mask, tokens, slot


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    token_order_ptr,
    group_starts_ptr,
    group_slots_ptr,
    k,
    rank_cols,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_xa,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program a (BLOCK_R rank columns, BLOCK_M tokens of a group, group); a[slot] is
    # [n_slices · R, K] row-major, its tile loaded K-major, [BLOCK_K, BLOCK_R].
    group = tl.program_id(2)
    first = tl.load(group_starts_ptr + group) + tl.program_id(1) * BLOCK_M
    end = tl.load(group_starts_ptr + group + 1)
    if first >= end:
        return
    rows, row_mask, tokens, slot = _group_tile(
        group_slots_ptr, token_order_ptr, group, first, end, BLOCK_M
    )
    cols = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_mask = cols < rank_cols
    depth = tl.arange(0, BLOCK_K)
    x_at = x_ptr + tokens[:, None] * stride_x + depth[None, :]
    a_at = a_ptr + slot * stride_a_slot + cols[None, :] * stride_a_row + depth[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_at, mask=row_mask[:, None], other=0.0)
            a = tl.load(a_at, mask=col_mask[None, :], other=0.0)
        else:
            in_k = depth < k - start
            x = tl.load(x_at, mask=row_mask[:, None] & in_k[None, :], other=0.0)
            a = tl.load(a_at, mask=in_k[:, None] & col_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
        x_at += BLOCK_K
        a_at += BLOCK_K
    xa_at = xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + cols[None, :]
    tl.store(xa_at, acc.to(xa_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    token_order_ptr,
    group_starts_ptr,
    group_slots_ptr,
    rank,
    bound0,
    bound1,
    bound2,
    bound3,
    stride_xa,
    stride_b_slot,
    stride_b_row,
    stride_out,
    NUM_SLICES: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program a (slice and BLOCK_N of its output columns, BLOCK_M tokens of a group,
    # group); b[slot] is [out_features, R] row-major, its tile loaded R-major,
    # [BLOCK_R, BLOCK_N]. Slice i reads xa's columns [i·R, (i+1)·R).
    which = tl.program_id(0) % NUM_SLICES
    lo = tl.where(which == 0, bound0, tl.where(which == 1, bound1, bound2))
    hi = tl.where(which == 0, bound1, tl.where(which == 1, bound2, bound3))
    first_col = lo + (tl.program_id(0) // NUM_SLICES) * BLOCK_N
    if first_col >= hi:
        return
    group = tl.program_id(2)
    first = tl.load(group_starts_ptr + group) + tl.program_id(1) * BLOCK_M
    end = tl.load(group_starts_ptr + group + 1)
    if first >= end:
        return
    rows, row_mask, tokens, slot = _group_tile(
        group_slots_ptr, token_order_ptr, group, first, end, BLOCK_M
    )
    cols = first_col + tl.arange(0, BLOCK_N)
    col_mask = cols < hi
    ranks = tl.arange(0, BLOCK_R)
    xa_at = xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + which * rank + ranks[None, :]
    b_at = b_ptr + slot * stride_b_slot + cols[None, :] * stride_b_row + ranks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        if EVEN_R:
            xa = tl.load(xa_at, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_at, mask=col_mask[None, :], other=0.0)
        else:
            in_r = ranks < rank - start
            xa = tl.load(xa_at, mask=row_mask[:, None] & in_r[None, :], other=0.0)
            b = tl.load(b_at, mask=in_r[:, None] & col_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xa, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, b, acc)
        xa_at += BLOCK_R
        b_at += BLOCK_R
    out_at = out_ptr + tokens[:, None] * stride_out + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    total = tl.load(out_at, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=mask)


def _check_groups(groups: LoRATokenGroups, out: Tensor, num_slots: int) -> None:
    if groups.token_order.device != out.device:
        raise ValueError(f"groups are on {groups.token_order.device}, out on {out.device}")
    if groups.group_slots_host[-1] >= num_slots:  # ascending: the last is the largest
        raise ValueError(f"slot {groups.group_slots_host[-1]} of a {num_slots}-slot layer")


def add_lora_triton(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    slice_bounds: tuple[int, ...],
    groups: LoRATokenGroups,
) -> None:
    """The Triton path of `add_lora`."""
    rank = check_lora(out, x, a, b, slice_bounds)
    _check_groups(groups, out, a.shape[0])
    num_slices = len(slice_bounds) - 1
    if num_slices > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} slices, got {num_slices}")
    if out.stride(1) != 1:
        raise ValueError("out needs unit stride along its columns")
    if rank == 0 or out.shape[1] == 0:
        return
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    k = x.shape[1]
    rank_cols = num_slices * rank
    num_groups = len(groups.group_slots_host)
    xa = torch.empty((groups.group_starts_host[-1], rank_cols), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    kind = "float32" if ieee else "16bit"

    config = launch_entry(_SHRINK_CONFIG)[kind]
    block_m, block_r, block_k = config["block_m"], config["block_r"], config["block_k"]
    grid = (triton.cdiv(rank_cols, block_r), triton.cdiv(groups.max_group_tokens, block_m))
    _lora_shrink_kernel[(*grid, num_groups)](
        x,
        a,
        xa,
        groups.token_order,
        groups.group_starts,
        groups.group_slots,
        k,
        rank_cols,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        xa.stride(0),
        IEEE=ieee,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )

    config = launch_entry(_EXPAND_CONFIG)[kind]
    block_m, block_n = config["block_m"], config["block_n"]
    block_r = min(config["block_r"], max(_MIN_DOT, triton.next_power_of_2(rank)))
    widest = max(hi - lo for lo, hi in zip(slice_bounds[:-1], slice_bounds[1:], strict=True))
    bounds = (*slice_bounds, *(slice_bounds[-1],) * (MAX_SLICES - num_slices))
    grid = (
        triton.cdiv(widest, block_n) * num_slices,
        triton.cdiv(groups.max_group_tokens, block_m),
    )
    _lora_expand_kernel[(*grid, num_groups)](
        xa,
        b,
        out,
        groups.token_order,
        groups.group_starts,
        groups.group_slots,
        rank,
        *bounds,
        xa.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        NUM_SLICES=num_slices,
        IEEE=ieee,
        EVEN_R=rank % block_r == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def add_lora(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    slice_bounds: tuple[int, ...],
    groups: LoRATokenGroups,
) -> None:
    """out [T, out_features] += each grouped token's LoRA product, in place: for token t of
    slot s, slice i's columns [slice_bounds[i], slice_bounds[i+1]) get
    (x[t] a[s, i·R:(i+1)·R]ᵀ) b[s, those columns]ᵀ (lora_reference.py states the layout).
    x [T, in_features]; out, x, a and b of one dtype (float32, float16 or bfloat16);
    tokens in no group are left alone."""
    if dispatch.use_triton():
        add_lora_triton(out, x, a, b, slice_bounds, groups)
    else:
        add_lora_reference(out, x, a, b, slice_bounds, groups)
