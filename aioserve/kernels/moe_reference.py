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
Triton kernels round at the same points (they scale the down product by the routing weight
before rounding it; here torch's matmul hands back a rounded product first, so the two may
differ by one rounding of a 16-bit y).

Here the pairs are sorted by expert (stable), each expert with tokens takes one product
for its gate/up and one for its down over all its rows, and the outputs go back to their
pairs by index: a Python loop over the experts that have tokens, none over tokens. Which
experts have tokens is read on the host (a sync, free on the CPU). Like the dense layers,
a pair's bits may depend on how many rows its expert's product has (torch's CPU GEMM picks
its blocking by shape), except in batch-invariant mode, where every expert's rows are
multiplied in fixed tiles of INVARIANT_TILE_ROWS, the last padded. On a CPU with bfloat16
arithmetic a bfloat16 model's experts are handed to oneDNN in its blocked layout once
(`pack_expert_weight`, as models/linear.py packs the dense layers) and multiplied there.
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
    layout (`pack_expert_weight`), read instead of w13 / w2."""
    num_tokens, top_k = topk_ids.shape
    out_dtype = x.dtype
    if num_tokens == 0:
        return x.new_empty(x.shape)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    sorted_rows = x.index_select(0, order // top_k)
    sorted_weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    sorted_out = torch.empty_like(sorted_rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        rows = sorted_rows[start:end]
        gate_up = _product(rows, w13[expert], packed_w13[expert] if packed_w13 else None)
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(out_dtype)
        down = _product(h, w2[expert], packed_w2[expert] if packed_w2 else None)
        sorted_out[start:end] = (down.float() * sorted_weights[start:end]).to(out_dtype)
        start = end
    pair_out = torch.empty_like(sorted_out)
    pair_out[order] = sorted_out
    return pair_out.view(num_tokens, top_k, -1).float().sum(dim=1).to(out_dtype)


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
