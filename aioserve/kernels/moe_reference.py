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

import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import dispatch

# Rows of one product in batch-invariant mode (as models/linear.py's dense layers).
INVARIANT_TILE_ROWS = 16
# The row count oneDNN lays a packed weight out for (as models/linear.py's).
PACKED_FOR_ROWS = 64
# Up to this many gate/up values (rows × 2I) a step's elementwise ops run once over every
# expert's rows (`_products_by_run`): 512 KiB of float32.
_SMALL_STEP_VALUES = 512 * 1024


def check_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
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
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
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
