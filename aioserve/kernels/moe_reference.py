"""Sparse mixture-of-experts in torch: the CPU's path and the oracle of the Triton kernels
(moe.py).

A sparse MoE block sends each token to `top_k` of E experts, each a SiLU-gated MLP, and
adds their outputs weighted by the router's probabilities. The layer keeps its experts'
weights stacked:

- `w13` [E, 2·I, H]: expert e's gate_proj rows, then its up_proj rows (the stacked
  gate_up_proj of a dense MLP, one product for both);
- `w2` [E, H, I]: expert e's down_proj.

`select_experts` turns the router's logits [T, E] into each token's experts `topk_ids`
[T, top_k] (int32) and their weights `topk_weights` [T, top_k] (float32): a softmax in
float32, the top_k largest (torch.topk's order: the largest first), renormalized to sum to
one where the model asks (Mixtral, Qwen3-MoE; not Qwen2-MoE by default).

`fused_moe_reference` computes, for each (token t, choice j) pair with expert e:

1. gate_up = x_t w13[e]ᵀ, accumulated in float32, rounded to x's dtype;
2. h = silu(gate) · up in float32, rounded to x's dtype;
3. y_tj = topk_weights[t, j] · (h w2[e]ᵀ), rounded to x's dtype;

and out_t = Σ_j y_tj, summed in float32 in the order j = 0, 1, ... and rounded once. The
Triton kernels round at exactly those points. Here torch's matmul hands back h w2[e]ᵀ
rounded, and the weight multiplies it in float32 as the sum adds it (out_t = Σ_j
topk_weights[t, j] · round(h w2[e]ᵀ)): the two may differ by one rounding of a 16-bit y.

With block-wise FP8 experts (`MoeFp8Scales`: DeepSeek's and Qwen3's `-FP8` checkpoints,
`fused_moe_fp8_reference`) each product is fp8_block_linear_reference.py's: its input
quantized to e4m3 per row and group of columns as it comes, the expert's e4m3 weight
scaled a block at a time; the rounding points are the same.

Here the pairs are sorted by expert (stable), each expert with tokens takes one product
for its gate/up and one for its down over all its rows (its "run"), and the outputs go
back to their pairs by index: a Python loop over the experts that have tokens, none over
tokens. Which experts have tokens is read on the host (a sync, free on the CPU). Like the
dense layers,
a pair's bits may depend on how many rows its expert's product has (torch's CPU GEMM picks
its blocking by shape), except in batch-invariant mode, where every expert's rows are
multiplied in fixed tiles of INVARIANT_TILE_ROWS, the last padded. On a CPU with bfloat16
arithmetic a bfloat16 model's experts are handed to oneDNN in its blocked layout once
(`pack_expert_weight`, as models/linear.py packs the dense layers) and multiplied there,
each run padded to one of a few lengths so that oneDNN meets few shapes
(`padded_run_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.fp8_block_linear_reference import fp8_block_linear_reference, scale_shape
from aioserve.kernels.fp8_linear_reference import FP8_DTYPES

# Rows of one product in batch-invariant mode (as models/linear.py's dense layers).
INVARIANT_TILE_ROWS = 16
# The row count oneDNN lays a packed weight out for (as models/linear.py's).
PACKED_FOR_ROWS = 64
# Up to this many gate/up values (rows × 2I) a step's elementwise ops run once over every
# expert's rows (`_products_by_run`): 512 KiB of float32.
_SMALL_STEP_VALUES = 512 * 1024


@dataclass(frozen=True)
class MoeFp8Scales:
    """The block-wise scales of e4m3 experts: w13's [E, ⌈2I / w13_rows⌉, ⌈H / group⌉] and
    w2's [E, ⌈H / w2_rows⌉, ⌈I / group⌉], float32; a block is `*_rows` weight rows by
    `group` columns (w13's rows one a weight row where gate's rows do not end on a block
    boundary: models/moe_fp8_weights.py)."""

    w13_scale: Tensor
    w2_scale: Tensor
    w13_rows: int
    w2_rows: int
    group: int


def _check_fp8_experts(w13: Tensor, w2: Tensor, fp8: MoeFp8Scales) -> None:
    if w13.dtype not in FP8_DTYPES or w2.dtype != w13.dtype:
        raise ValueError(f"FP8 experts must be e4m3, got {w13.dtype} / {w2.dtype}")
    for name, weight, scale, rows in (
        ("w13", w13, fp8.w13_scale, fp8.w13_rows),
        ("w2", w2, fp8.w2_scale, fp8.w2_rows),
    ):
        expected = (weight.shape[0], *scale_shape(*weight.shape[1:], (rows, fp8.group)))
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}'s block scales must be float32 {list(expected)}, got {scale.dtype} "
                f"{list(scale.shape)}"
            )


def check_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    fp8: MoeFp8Scales | None = None,
) -> None:
    """Raise ValueError when the operands of a fused MoE do not fit together."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused MoE takes x [T, H], w13 [E, 2I, H] and w2 [E, H, I]; got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if hidden != x.shape[1] or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"fused MoE shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError("topk_ids and topk_weights must both be [T, top_k]")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{topk_ids.shape[0]} routed tokens for {x.shape[0]} rows of x")
    if fp8 is not None:
        _check_fp8_experts(w13, w2, fp8)
    elif x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x is {x.dtype} but the experts are {w13.dtype} / {w2.dtype}")


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]) of the router's logits
    [T, E]: softmax in float32, the top_k largest, renormalized when asked."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_reference(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    packed_w13: Sequence[Tensor] = (),
    packed_w2: Sequence[Tensor] = (),
) -> Tensor:
    """The MoE block's output [T, H] in x's dtype (the module docstring's definition).

    `packed_w13` / `packed_w2`, when given, hold each expert's weights in oneDNN's blocked
    layout (`pack_expert_weight`), read instead of w13 / w2; each expert's run of rows is
    then padded to one of a few sizes (`padded_run_rows`)."""
    num_tokens, top_k = topk_ids.shape
    out_dtype = x.dtype
    if num_tokens == 0:
        return x.new_empty(x.shape)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    runs = [(expert, count) for expert, count in enumerate(counts) if count]
    sizes = [padded_run_rows(count) if packed_w13 else count for _, count in runs]
    sorted_tokens = order // top_k
    if sizes == [count for _, count in runs]:
        places = torch.arange(order.numel())
        rows = x.index_select(0, sorted_tokens)
    else:
        # Pair i of the sorted order goes to row places[i] of the padded runs; the padding
        # rows multiply token 0's values, and their results are never read.
        shifts = [0]
        for (_, count), size in zip(runs[:-1], sizes[:-1], strict=True):
            shifts.append(shifts[-1] + size - count)
        run_lengths = torch.tensor([count for _, count in runs])
        places = torch.arange(order.numel()) + torch.tensor(shifts).repeat_interleave(run_lengths)
        gather = torch.zeros(sum(sizes), dtype=torch.long)
        gather[places] = sorted_tokens
        rows = x.index_select(0, gather)
    products = _products_by_run(rows, sizes, runs, w13, w2, packed_w13, packed_w2)
    row_of_pair = torch.empty_like(places)
    row_of_pair[order] = places
    # Each choice's products contiguous, [top_k, T, H]: adding a strided view of [T, top_k,
    # H] cast as it went took 4x as long.
    by_choice = products.index_select(0, row_of_pair.view(num_tokens, top_k).t().reshape(-1))
    by_choice = by_choice.view(top_k, num_tokens, -1)
    out = by_choice[0].float().mul_(topk_weights[:, :1])
    for choice in range(1, top_k):
        out.addcmul_(by_choice[choice], topk_weights[:, choice : choice + 1])
    return out.to(out_dtype)


def fused_moe_fp8_reference(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    fp8: MoeFp8Scales,
) -> Tensor:
    """The MoE block's output [T, H] in x's dtype with block-wise FP8 experts (the module
    docstring's definition, each product fp8_block_linear_reference's), expert by expert."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    y = x.new_empty(flat_ids.numel(), x.shape[1])
    for expert in torch.unique(flat_ids).tolist():
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        rows = x.index_select(0, pairs // top_k)
        up_block, down_block = (fp8.w13_rows, fp8.group), (fp8.w2_rows, fp8.group)
        gate_up = fp8_block_linear_reference(rows, w13[expert], fp8.w13_scale[expert], up_block)
        h = _silu_and_mul(gate_up, x.dtype)
        y[pairs] = fp8_block_linear_reference(h, w2[expert], fp8.w2_scale[expert], down_block)
    by_choice = y.view(num_tokens, top_k, -1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for choice in range(top_k):
        out.addcmul_(by_choice[:, choice], topk_weights[:, choice : choice + 1])
    return out.to(x.dtype)


def _products_by_run(
    rows: Tensor,
    sizes: list[int],
    runs: list[tuple[int, int]],
    w13: Tensor,
    w2: Tensor,
    packed_w13: Sequence[Tensor],
    packed_w2: Sequence[Tensor],
) -> Tensor:
    """down(silu(gate) · up) of each run's rows, the runs one after the other.

    A small step (decodes: a few rows an expert) takes each product expert by expert and
    the elementwise ops once over every run, as each op's call costs more than its work
    there; a large one (prefill) goes expert by expert throughout, so that a run's rows stay
    in cache from one product to the next (once over a 2,048-token step's 16,384 pairs, the
    float32 temporaries made it 2.7x slower). The values are the same either way."""
    dtype = rows.dtype
    experts = [expert for expert, _ in runs]

    def gate_up(expert: int, run: Tensor) -> Tensor:
        return _product(run, w13[expert], packed_w13[expert] if packed_w13 else None)

    def down(expert: int, h: Tensor) -> Tensor:
        return _product(h, w2[expert], packed_w2[expert] if packed_w2 else None)

    if rows.shape[0] * w13.shape[1] <= _SMALL_STEP_VALUES:
        runs_rows = zip(experts, rows.split(sizes), strict=True)
        h = _silu_and_mul(torch.cat([gate_up(e, run) for e, run in runs_rows]), dtype)
        return torch.cat([down(e, run) for e, run in zip(experts, h.split(sizes), strict=True)])
    runs_rows = zip(experts, rows.split(sizes), strict=True)
    return torch.cat([down(e, _silu_and_mul(gate_up(e, run), dtype)) for e, run in runs_rows])


def _silu_and_mul(gate_up: Tensor, dtype: torch.dtype) -> Tensor:
    """silu(gate) · up in float32, rounded to `dtype`, with one float32 temporary."""
    half = gate_up.shape[-1] // 2
    h = F.silu(gate_up[:, :half].float(), inplace=True)
    return h.mul_(gate_up[:, half:]).to(dtype)


def padded_run_rows(count: int) -> int:
    """The rows oneDNN multiplies for an expert's run of `count`: 1, else the first of 8, 12,
    16, 24, 32, 48, ... (2ⁿ and 1.5·2ⁿ) that holds it.

    oneDNN builds a primitive for every shape it multiplies and keeps the last few
    (aioserve/host_memory.py bounds its caches to 16 entries); a step's experts have runs of
    every length, so unpadded they rebuilt primitives all the time (64 random prompts on a
    64-expert model: 40 s where 23 s with oneDNN's default caches). Up to 8 rows a product
    takes as long as one row (it reads the weight), and above that a third more rows at
    most cost less than a rebuilt primitive (~0.7 ms)."""
    if count <= 1:
        return count
    size = 8
    while True:
        if count <= size:
            return size
        if count <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


def pack_expert_weight(weight: Tensor) -> Tensor:
    """One expert's [N, K] bfloat16 weight in oneDNN's blocked layout: torch's own bfloat16
    product reorders a plain weight on every call, which took ~0.9 ms for one row of a
    [768, 1024] expert on a Zen 5 EPYC against ~30 us packed."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def _product(rows: Tensor, weight: Tensor, packed: Tensor | None) -> Tensor:
    """rows weightᵀ: by oneDNN on the packed weight where there is one; in batch-invariant
    mode (which packs nothing) in tiles of INVARIANT_TILE_ROWS rows."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    if not dispatch.batch_invariant():
        return F.linear(rows, weight)
    count = rows.shape[0]
    padded = -count % INVARIANT_TILE_ROWS
    if padded:
        rows = torch.cat([rows, rows.new_zeros(padded, rows.shape[1])])
    tiles = [F.linear(tile, weight) for tile in rows.split(INVARIANT_TILE_ROWS)]
    return torch.cat(tiles)[:count]
