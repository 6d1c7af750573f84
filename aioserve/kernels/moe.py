"""Sparse mixture-of-experts on a GPU: the (token, choice) pairs sorted by expert and padded
to whole tiles, then one grouped GEMM kernel for the gate/up product and again for the down
product (vLLM's fused_moe scheme, written afresh).

moe_reference.py states the layout (w13 [E, 2·I, H] gate rows then up rows, w2 [E, H, I]),
the routing and the rounding points. For T tokens routed to top_k experts each there are
P = T·top_k pairs, pair p = t·top_k + j being token t's j-th choice. A call:

1. `align_pairs_to_blocks`: the pairs sorted by expert (stable), each expert's run padded
   to a multiple of BLOCK_M, as `sorted_pair_ids` (the padding holds the sentinel P) and
   `block_experts`, each BLOCK_M block's expert (-1 past the last block). Torch ops only,
   of shapes fixed by T, top_k and E, and no host sync, so a CUDA/HIP graph captures it:
   E experts of P pairs need at most P + min(E, P)·(BLOCK_M − 1) rows.
2. `_moe_gemm_kernel` for gate_up [P, 2·I] = x[p // top_k] w13[e]ᵀ: one program a
   (BLOCK_M block, BLOCK_N output columns), K walked in BLOCK_K steps with tl.dot into a
   float32 accumulator (IEEE products for float32 operands), rounded to x's dtype; the
   rows of a block are gathered through its pair ids, padding rows read row 0 and are
   never stored. Blocks are the grid's fastest axis, so the programs running together
   share an expert's weight tile through the cache.
3. h [P, I] = silu(gate) · up, activation.py's kernel (rounded to x's dtype).
4. `_moe_gemm_kernel` again for y [P, H] = h[p] w2[e]ᵀ, the float32 accumulator times the
   pair's routing weight before its one rounding.
5. `_sum_choices_kernel`: out [T, H] = Σ_j y[t·top_k + j], in float32 in the order
   j = 0, 1, ... and rounded once (torch's sum may split a short reduction by shape).

With block-wise FP8 experts (`MoeFp8Scales`: Qwen3's `-FP8` MoE checkpoints) x and h are
first quantized to e4m3 per row and group of columns (fp8_block_linear.py's quantizer, once
per token for x, not per pair), both products run on the 8-bit tiles, and each BLOCK_K step
(within one group) is scaled by its rows' and its expert's block scales as it is added.

Tiles come from fixed per-family tables, never from the batch, and K is never split: a
pair's bits are the same whatever else its batch holds (batch-invariant as it stands).
The intermediates are indexed by pair, so each program writes rows of its own and no
atomics are needed. On the CPU `fused_moe` runs the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.activation import silu_and_mul_triton
from aioserve.kernels.fp8_block_linear import quantize_groups_triton
from aioserve.kernels.fp8_linear_reference import FP8_DTYPES
from aioserve.kernels.moe_reference import (
    MoeFp8Scales,
    check_moe,
    fused_moe_fp8_reference,
    fused_moe_reference,
)
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# One tile for both products of a call: BLOCK_M sorted pairs (all of one expert) × BLOCK_N
# output columns, K in BLOCK_K steps. One entry per platform or family and dtype kind;
# the 16-bit ones compile without a register spill within the family's shared memory on
# sm_90a, sm_80, gfx942, gfx90a and gfx1100 at Mixtral-8x7B's, Qwen3-30B-A3B's and a small
# layer (tests/kernels/test_gpu_compile.py), float32 checked the same way by hand, and all
# of them also as a real launch compiles them (pointers and strides known 16-aligned, which
# the test's compile does not assume: there loads are scalar and registers go to addresses).
# BLOCK_M is 64 everywhere: a decode pads each expert's few pairs to one block (the idle
# rows cost tensor-core time, not the weight traffic that bounds a decode), a prefill reads
# a weight tile once per 64 pairs. BLOCK_N 64 gives Mixtral's one-token down product 128
# programs (4096 columns, two experts), not 64 at 128 columns. Tried and spilled (the
# test's compile): 4 warps on sm_80 (20 bytes, at 255 registers; 124 registers aligned),
# 4 warps × 3 stages on gfx1100 (19; 4 × 2 fits at 244 registers, so 8 warps there); in
# float32 32 × 64 × 32 spilled 4 bytes on sm_80 aligned, on 4 and on 8 warps, and 4 warps
# on gfx1100 3 bytes with a K tail. sm_90a's 4 warps (one warpgroup, m64 wgmma) sit at 255
# registers unaligned, 72 aligned. Checked with and without a K tail. Not yet timed on a
# GPU. The "cpu" rows are the interpreter's (fast tests).
# FP8 experts (e4m3 with block-wise scales) hold each step's product beside the sum: the
# 16-bit tiles spilled 124-132 bytes on sm_90a (8 warps do not) and 29 on gfx1100 (64 × 32
# does not); gfx942 and gfx90a take theirs as they are. Ampere has no e4m3 (no entry).
_FLOAT32 = {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
_CPU = {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 1, "num_stages": 1}
_ROCM_16BIT = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}
_CONFIG: dict[str, dict[str, dict[str, int]]] = {
    "hopper": {
        "16bit": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4},
        "float32": _FLOAT32,
        "fp8": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3},
    },
    "ampere": {
        "16bit": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3},
        "float32": _FLOAT32,
    },
    "rocm": {"16bit": _ROCM_16BIT, "float32": _FLOAT32, "fp8": _ROCM_16BIT},
    "rdna3": {
        "16bit": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 2},
        "float32": _FLOAT32 | {"num_warps": 8},
        "fp8": {"block_m": 64, "block_n": 32, "block_k": 64, "num_warps": 8, "num_stages": 2},
    },
    "cpu": {"16bit": _CPU, "float32": _CPU, "fp8": _CPU},
}  # fmt: skip
# The sum over the choices: hidden columns one program adds, and its warps.
_SUM_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block": 1024, "num_warps": 4},
    "rocm": {"block": 1024, "num_warps": 4},
    "cpu": {"block": 1024, "num_warps": 1},
}


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    pair_weights_ptr,
    a_scale_ptr,
    w_scale_ptr,
    num_pairs,
    a_row_divisor,
    n,
    k,
    num_groups,
    stride_a,
    stride_w_expert,
    stride_w_row,
    stride_w_scale_expert,
    stride_out,
    WEIGHTED: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program a (BLOCK_M block of sorted pairs, BLOCK_N output columns): out[pair,
    # cols] = a[pair // a_row_divisor] w[expert, cols]ᵀ, the weight [N, K] row-major, its
    # tile loaded K-major, [BLOCK_K, BLOCK_N]. Padding rows (pair id num_pairs) read a's
    # row 0 and are not stored; columns past n wrap onto real ones and are not stored.
    # FP8: a and w are e4m3 with block-wise scales (fp8_block_linear_reference.py), a's
    # [rows, num_groups], w's [E, ⌈N / SCALE_ROWS⌉, num_groups]; each BLOCK_K step (within
    # one group of GROUP columns) is scaled by its group's scales as it is added.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + slots)
    row_mask = pairs < num_pairs
    a_rows = tl.where(row_mask, pairs // a_row_divisor, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    depth = tl.arange(0, BLOCK_K)
    a_at = a_ptr + a_rows[:, None] * stride_a + depth[None, :]
    w_at = (
        w_ptr
        + expert.to(tl.int64) * stride_w_expert
        + (cols % n).to(tl.int64)[None, :] * stride_w_row
        + depth[:, None]
    )
    if FP8:
        a_scale_at = a_scale_ptr + a_rows * num_groups
        w_scale_rows = (cols % n) // SCALE_ROWS
        w_scale_at = w_scale_ptr + expert * stride_w_scale_expert + w_scale_rows * num_groups
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_at)
            w = tl.load(w_at)
        else:
            in_k = depth < k - start
            a = tl.load(a_at, mask=in_k[None, :], other=0.0)
            w = tl.load(w_at, mask=in_k[:, None], other=0.0)
        if FP8:
            product = tl.dot(a, w, max_num_imprecise_acc=BLOCK_K)
            group = start // GROUP
            a_scale = tl.load(a_scale_at + group)
            w_scale = tl.load(w_scale_at + group)
            acc += product * a_scale[:, None] * w_scale[None, :]
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_at += BLOCK_K
        w_at += BLOCK_K
    if WEIGHTED:
        scale = tl.load(pair_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out_at = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _sum_choices_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # One program a (token, BLOCK columns): out[t] = Σ_j y[t·TOP_K + j] in float32, in the
    # order j = 0, 1, ..., rounded once.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = y_ptr + (token * TOP_K + j) * hidden
        total += tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def moe_config(dtype: torch.dtype) -> dict[str, int]:
    """This device's tile for experts of `dtype` (16-bit, float32 or e4m3)."""
    if dtype in FP8_DTYPES:
        return launch_entry(_CONFIG)["fp8"]
    return launch_entry(_CONFIG)["float32" if dtype == torch.float32 else "16bit"]


def align_pairs_to_blocks(
    topk_ids: Tensor, num_experts: int, block_m: int
) -> tuple[Tensor, Tensor]:
    """(sorted_pair_ids int32 [S], block_experts int32 [S / block_m]) of topk_ids [T, top_k]:
    the pairs p = t·top_k + j sorted by expert (stable), each expert's run padded with the
    sentinel P = T·top_k to a multiple of block_m, the rest of S the sentinel too; block b's
    expert, -1 for blocks past the last expert's. S = P + min(E, P)·(block_m − 1) rounded up
    to block_m, a bound that depends on the shapes alone. Torch ops, no host sync."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    experts = topk_ids.reshape(-1).long()
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    # Not bincount: on CUDA it reads the ids' range back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    dest = padded_starts[sorted_experts] + rank
    sorted_pair_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    # Every block of an expert's run holds at least one of its pairs, so each is written
    # (by all of them with the same value).
    block_experts = torch.full((rows // block_m,), -1, dtype=torch.int32, device=device)
    block_experts.scatter_(0, dest // block_m, sorted_experts.to(torch.int32))
    return sorted_pair_ids, block_experts


def _grouped_gemm(
    a: Tensor,
    weight: Tensor,
    out: Tensor,
    sorted_pair_ids: Tensor,
    block_experts: Tensor,
    pair_weights: Tensor | None,
    a_row_divisor: int,
    config: dict[str, int],
    fp8: tuple[Tensor, Tensor, int, int] | None = None,
) -> None:
    """out[pair] = a[pair // a_row_divisor] weight[expert]ᵀ (× the pair's weight); with
    `fp8` = (a's scales, the weight's, the weight's rows a scale row, columns a group), a
    and the weight are block-scaled e4m3."""
    n, k = weight.shape[1], weight.shape[2]
    block_n, block_k = config["block_n"], config["block_k"]
    a_scale, w_scale, scale_rows, group = fp8 if fp8 is not None else (out, out, 1, 1)
    if fp8 is not None:
        block_k = min(block_k, group)
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        weight,
        out,
        sorted_pair_ids,
        block_experts,
        pair_weights if pair_weights is not None else out,
        a_scale,
        w_scale,
        out.shape[0],
        a_row_divisor,
        n,
        k,
        a_scale.shape[-1] if fp8 is not None else 0,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        w_scale.stride(0) if fp8 is not None else 0,
        out.stride(0),
        WEIGHTED=pair_weights is not None,
        IEEE=a.dtype == torch.float32,
        FP8=fp8 is not None,
        SCALE_ROWS=scale_rows,
        GROUP=group,
        EVEN_K=k % block_k == 0,
        BLOCK_M=config["block_m"],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def fused_moe_triton(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    fp8: MoeFp8Scales | None = None,
) -> Tensor:
    """The Triton path of `fused_moe`."""
    check_moe(x, w13, w2, topk_weights, topk_ids, fp8)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0 or top_k == 0:
        return x.new_zeros(x.shape)
    x, w13, w2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13, w2))
    config = moe_config(w13.dtype if fp8 is not None else x.dtype)
    sorted_pair_ids, block_experts = align_pairs_to_blocks(topk_ids, num_experts, config["block_m"])
    num_pairs = num_tokens * top_k
    gate_up = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    a, up_scales = x, None
    if fp8 is not None:
        a, a_scale = quantize_groups_triton(x, fp8.group, w13.dtype)
        up_scales = (a_scale, fp8.w13_scale.contiguous(), fp8.w13_rows, fp8.group)
    _grouped_gemm(a, w13, gate_up, sorted_pair_ids, block_experts, None, top_k, config, up_scales)
    h = silu_and_mul_triton(gate_up)
    down_scales = None
    if fp8 is not None:
        h, h_scale = quantize_groups_triton(h, fp8.group, w2.dtype)
        down_scales = (h_scale, fp8.w2_scale.contiguous(), fp8.w2_rows, fp8.group)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    pair_weights = topk_weights.reshape(-1).float()
    _grouped_gemm(h, w2, y, sorted_pair_ids, block_experts, pair_weights, 1, config, down_scales)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    sum_config = launch_entry(_SUM_CONFIG)
    block = min(triton.next_power_of_2(hidden), sum_config["block"])
    _sum_choices_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=sum_config["num_warps"]
    )
    return out


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    packed_w13: list[Tensor] | tuple[Tensor, ...] = (),
    packed_w2: list[Tensor] | tuple[Tensor, ...] = (),
    fp8: MoeFp8Scales | None = None,
) -> Tensor:
    """The sparse MoE block's output [T, H] in x's dtype: for each token t, Σ_j
    topk_weights[t, j] · expert topk_ids[t, j]'s SiLU-gated MLP of x[t] (moe_reference.py
    states the layout and the rounding). x [T, H]; w13 [E, 2·I, H], w2 [E, H, I] in x's
    dtype, or with `fp8` in e4m3 with block-wise scales; topk_weights float32 and topk_ids
    int [T, top_k], every id below E. The CPU's oneDNN-packed experts, where a model keeps
    them (moe_reference.pack_expert_weight), are read instead of w13 / w2 by the reference."""
    if dispatch.use_triton():
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, fp8)  # checks the operands
    check_moe(x, w13, w2, topk_weights, topk_ids, fp8)
    if fp8 is not None:
        return fused_moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, fp8)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, packed_w13, packed_w2)
