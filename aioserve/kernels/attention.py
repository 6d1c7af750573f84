"""Paged attention over the KV cache for one model step: prefill chunks and decodes mixed.

The step's queries are one flat batch: sequence b owns query rows
`query_start_loc[b]:query_start_loc[b+1]` of `query` [T, num_q_heads, head_size], and its
keys and values, new tokens included, are already in the paged cache
[num_blocks, block_size, num_kv_heads, head_size], reached through row b of
`block_tables`. `seq_lens[b]` counts all of them, so query row i (of q_len) sits at
position seq_len - q_len + i and attends causally to keys 0..that position (with a
sliding window W > 0, to its last W keys only). Query head h reads kv head
h // (num_q_heads // num_kv_heads) (grouped-query attention, GQA).

Two paths compute it. The Triton kernels (attention_triton.py; their tiles by device in
attention_launch.py) run on a GPU; torch (attention_reference.py) runs on the CPU, where
it is the production path, and is the kernels' oracle. `paged_attention` takes the path
the device runs (dispatch.py), and `plan_attention` works out, once a step, what that
path needs from the step's host arrays.

An fp8 cache (kv_cache.py) holds the keys and values scaled: its layer's k_scale
multiplies the scores and v_scale the weighted sum of values.

Rows of `out` past `query_start_loc[-1]` (padding) are not written.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.attention_reference import (
    ReferencePlan,
    paged_attention_reference,
    plan_reference_attention,
)
from aioserve.kernels.attention_triton import paged_attention_triton


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: Tensor | None = None,
    plan: ReferencePlan | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    new_kv: tuple[Tensor, Tensor] | None = None,
    sliding_window: int = 0,
) -> Tensor:
    """Causal attention of the step's query rows over their sequences' paged KV cache.

    query [T, Hq, D]; key_cache/value_cache [num_blocks, block_size, Hkv, D];
    query_start_loc int32 [B+1]; seq_lens int32 [B] (context including the new tokens);
    block_tables int32 [B, max_blocks_per_seq]. Returns [T, Hq, D] in query's dtype,
    written into `out` when given. `plan` is the step's plan from `plan_attention`, shared
    by all layers. An fp8 cache needs its layer's k_scale and v_scale ([1] float32).
    `new_kv`, the step's keys and values [T, Hkv, D] just written to the cache, lets the
    torch path read a prompt with nothing cached before it from them; the Triton kernels
    read the cache. A `sliding_window` W > 0 limits each row to the last W positions
    through its own (keys p - W + 1 .. p for the row at position p, as transformers' and
    vLLM's sliding windows); 0 attends the whole context.
    """
    if dispatch.use_triton():
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            scale,
            max_query_len,
            max_seq_len,
            out,
            k_scale,
            v_scale,
            sliding_window,
        )
    return paged_attention_reference(
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len,
        max_seq_len,
        out,
        plan,
        k_scale,
        v_scale,
        new_kv,
        sliding_window,
    )


def plan_attention(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
    slot_mapping: np.ndarray | None = None,
) -> ReferencePlan | None:
    """What the running attention path works out once per step, from the step's host arrays.

    The torch path plans which rows decode and which blocks each reads (see
    attention_reference.py), and, given the step's slot_mapping, where each layer writes
    its keys and values; the Triton kernels need no plan.
    """
    if dispatch.use_triton():
        return None
    return plan_reference_attention(
        query_start_loc, seq_lens, block_tables, block_size, device, slot_mapping
    )
