"""The Triton path of paged attention: what it computes is in attention.py.

Two kernels, and every sequence goes to exactly one of them by its own q_len, so the split
never depends on the rest of the batch:

- the decode kernel takes the sequences with q_len == 1: one program per
  (sequence, kv head, segment) holds the whole GQA group of query heads as the rows of
  one tile and walks the segment's keys from first to last. Segments have a fixed number
  of keys (`decode_segment`, by device), so a long context is spread over many programs
  even at batch 1; a sequence of several segments has them merged, in segment order, by
  a second kernel (split-KV, as flash-decoding does);
- the prefill kernel takes the sequences with q_len > 1: one program per
  (tile of query tokens, kv head), its rows being BLOCK_Q consecutive tokens times the GQA
  group, again walking the keys from first to last, up to the tile's causal limit.

Both use the same inner loop: keys in tiles of BLOCK_N positions read through the block
table (so any block size works), online softmax in float32, tl.dot for QK^T and PV. The
launch grid of the prefill kernel counts tiles over the whole flat batch; each program finds
its sequence by binary search over `query_start_loc`. Tiles start at fixed offsets within
their sequence, block sizes depend only on the device and the head size, and keys are
always reduced in the same order (a decode's segments too: how it splits depends on its
own length only), so a sequence's output is bitwise the same whatever shares its batch
(DESIGN: batch invariance).

A sliding window runs the SLIDING kernels (for every batch of the model): a prefill tile
walks from its first row's window start, its later rows masking the keys before theirs; a
decode's segments wholly before its window do nothing, its first live segment starting at
the window's first key (segment boundaries stay fixed, and only live segments are merged).

An fp8 cache (kv_cache.py) is loaded as stored and converted to the query's dtype in
registers; its layer's k_scale is folded into the softmax scale, and v_scale multiplies the
weighted sum of values.

Rows of `out` past `query_start_loc[-1]` (padding) are not written.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aioserve.kernels.attention_launch import MIN_DOT, launch_config
from aioserve.kernels.attention_reference import check_shapes
from aioserve.kernels.kv_cache import is_fp8
from aioserve.kernels.triton_compat import tl, triton


@triton.jit
def _attend_keys(
    q,
    row_positions,
    first_key,
    num_keys,
    block_table_ptr,
    key_head_ptr,
    value_head_ptr,
    stride_key_block,
    stride_key_slot,
    stride_value_block,
    stride_value_slot,
    block_size,
    head_size,
    qk_scale,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Attention of the query rows `q` [BLOCK_M, BLOCK_D] over keys first_key..num_keys-1,
    unnormalized: (sum of p·v, the rows' running max, the sum of p), all float32.

    Row r attends to keys up to row_positions[r] (SLIDING: and past row_positions[r] -
    window). The first key is visible to every row, but to the later rows of a SLIDING
    prefill tile: those may see no key of a whole tile. The keys come in tiles of BLOCK_N
    positions, each position's physical block looked up in the sequence's block table.
    `qk_scale` is the softmax scale times log2(e): the softmax runs in base 2. An fp8 cache
    (KV_FP8) is converted to the query's dtype as loaded, unscaled: the caller scales.
    """
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_size
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(first_key, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < num_keys
        # Masked loads: table entries and cache slots past the sequence are never read.
        blocks = tl.load(block_table_ptr + keys // block_size, mask=key_mask, other=0)
        blocks = blocks.to(tl.int64)
        in_block = keys % block_size
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        key_rows = blocks * stride_key_block + in_block * stride_key_slot
        k = tl.load(key_head_ptr + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        value_rows = blocks * stride_value_block + in_block * stride_value_slot
        v = tl.load(value_head_ptr + value_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # through float32, which every fp8 format converts to exactly
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        # Causality also hides the keys past num_keys from every row that gets stored.
        if SLIDING:  # 0 <= position - key < window, in one unsigned comparison
            visible = (row_positions[:, None] - keys[None, :]).to(tl.uint32) < window
        else:
            visible = keys[None, :] <= row_positions[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        # Once a row has seen a key, its row_max is finite and a tile it cannot see changes
        # its state by exactly nothing; SLIDING, one that has seen none shifts by 0, not -inf.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = new_max
        if SLIDING:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - shift)
        p = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    partial_ptr,
    partial_stats_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_key_block,
    stride_key_slot,
    stride_key_head,
    stride_value_block,
    stride_value_slot,
    stride_value_head,
    stride_block_table,
    block_size,
    head_size,
    window,
    max_segments,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEGMENT: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # One program per (sequence, kv head, segment of SEGMENT keys); rows are the GQA
    # group's query heads. A sequence of one live segment writes its output; a longer one
    # writes each segment's unnormalized sum and its (max, sum) for _merge_segments_kernel.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_segments = tl.cdiv(seq_len, SEGMENT)
    if segment >= num_segments:
        return
    live_segments = num_segments
    if SLIDING:
        # Segments wholly before the window are dead; the first live one starts at its first key.
        window_start = tl.maximum(seq_len - window, 0)
        if segment < window_start // SEGMENT:
            return
        live_segments = num_segments - window_start // SEGMENT

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < GROUP)[:, None] & (dims < head_size)[None, :]
    token = query_start.to(tl.int64)
    q = tl.load(
        query_ptr + token * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    # SLIDING, the tiles from the window's first key may overrun the segment: hide what is past.
    last_position = tl.minimum(seq_len - 1, (segment + 1) * SEGMENT - 1) if SLIDING else seq_len - 1
    row_positions = tl.zeros([BLOCK_G], dtype=tl.int32) + last_position
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    acc, row_max, row_sum = _attend_keys(
        q,
        row_positions,
        tl.maximum(segment * SEGMENT, window_start) if SLIDING else segment * SEGMENT,
        tl.minimum(seq_len, (segment + 1) * SEGMENT),
        block_tables_ptr + seq.to(tl.int64) * stride_block_table,
        key_cache_ptr + kv_head * stride_key_head,
        value_cache_ptr + kv_head * stride_value_head,
        stride_key_block,
        stride_key_slot,
        stride_value_block,
        stride_value_slot,
        block_size,
        head_size,
        qk_scale,
        window,
        BLOCK_G,
        BLOCK_N,
        BLOCK_D,
        KV_FP8,
        False,  # every row's window starts at the first key or before
    )
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if live_segments == 1:
        tl.store(
            out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
            (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # partial [B, Hq, max_segments, BLOCK_D] float32; stats [B, Hq, max_segments, 2].
        slots = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * max_segments + segment
        tl.store(partial_ptr + slots[:, None] * BLOCK_D + dims[None, :], acc, mask=mask)
        row_mask = rows < GROUP
        tl.store(partial_stats_ptr + slots * 2, row_max, mask=row_mask)
        tl.store(partial_stats_ptr + slots * 2 + 1, row_sum, mask=row_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_ptr,
    partial_stats_ptr,
    stride_out_token,
    stride_out_head,
    head_size,
    max_segments,
    window,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEGMENT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # One program per (sequence, query head) of a decode split into segments: the live
    # segments' sums (SLIDING: from the window's first one) rescaled to the largest max
    # and added in segment order (a fixed order, so the result does not depend on the batch).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_segments = tl.cdiv(seq_len, SEGMENT)
    first_segment = tl.maximum(seq_len - window, 0) // SEGMENT if SLIDING else 0
    if (query_len != 1) | (num_segments - first_segment <= 1):
        return
    first_slot = (seq.to(tl.int64) * tl.num_programs(1) + head) * max_segments
    segments = tl.arange(0, BLOCK_S)
    in_seq = segments < num_segments
    if SLIDING:
        in_seq = in_seq & (segments >= first_segment)
    maxes = tl.load(partial_stats_ptr + (first_slot + segments) * 2, mask=in_seq, other=-1e30)
    top = tl.max(maxes, axis=0)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for segment in range(first_segment, num_segments):
        slot = first_slot + segment
        scale = tl.exp2(tl.load(partial_stats_ptr + slot * 2) - top)
        total += scale * tl.load(partial_stats_ptr + slot * 2 + 1)
        acc += scale * tl.load(partial_ptr + slot * BLOCK_D + dims)
    token = query_start.to(tl.int64)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence that prefill tile `tile` belongs to.

    Sequence b's tiles are numbered from query_start_loc[b] // BLOCK_Q + b on, which leaves
    room for its ceil(q_len / BLOCK_Q) tiles; the answer is the last b whose first tile
    number is <= tile (binary search).
    """
    low: tl.int32 = 0
    high: tl.int32 = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    num_seqs,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_key_block,
    stride_key_slot,
    stride_key_head,
    stride_value_block,
    stride_value_slot,
    stride_value_head,
    stride_block_table,
    block_size,
    head_size,
    window,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # One program per (tile of BLOCK_Q query tokens, kv head); row r of the tile is token
    # r // GROUP of the tile and query head r % GROUP of the kv head's group.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = (tile - (query_start // BLOCK_Q + seq)) * BLOCK_Q
    # Sequences with one query token are the decode kernel's.
    if (query_len <= 1) | (first_token >= query_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tokens < query_len)
    dims = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (dims < head_size)[None, :]
    token_offsets = (query_start + tokens).to(tl.int64)
    q = tl.load(
        query_ptr
        + token_offsets[:, None] * stride_query_token
        + heads[:, None] * stride_query_head
        + dims[None, :],
        mask=mask,
        other=0.0,
    )
    last_token = tl.minimum(first_token + BLOCK_Q, query_len) - 1
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # SLIDING, from the first row's window start; _attend_keys masks the later rows' own.
    acc, _, row_sum = _attend_keys(
        q,
        context_len + tokens,
        tl.maximum(context_len + first_token + 1 - window, 0) if SLIDING else 0,
        context_len + last_token + 1,
        block_tables_ptr + seq.to(tl.int64) * stride_block_table,
        key_cache_ptr + kv_head * stride_key_head,
        value_cache_ptr + kv_head * stride_value_head,
        stride_key_block,
        stride_key_slot,
        stride_value_block,
        stride_value_slot,
        block_size,
        head_size,
        qk_scale,
        window,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        KV_FP8,
        SLIDING,
    )
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    tl.store(
        out_ptr
        + token_offsets[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + dims[None, :],
        (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def paged_attention_triton(
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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    sliding_window: int = 0,
) -> Tensor:
    """The Triton path of `paged_attention`: the decode kernel, then the prefill kernel."""
    check_shapes(query, key_cache, value_cache, block_tables, max_seq_len, k_scale, v_scale)
    kv_fp8 = is_fp8(key_cache.dtype)
    if value_cache.dtype != key_cache.dtype or not (kv_fp8 or query.dtype == key_cache.dtype):
        raise ValueError("the Triton path needs a KV cache of the query's dtype, or fp8")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query and KV cache need unit stride along head_size")
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    sliding = sliding_window > 0  # one kernel per model, whatever the batch's lengths
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out

    block_d = max(MIN_DOT, triton.next_power_of_2(head_size))
    config = launch_config(block_d, kv_fp8)
    qk_scale = scale * math.log2(math.e)
    # The strides (query's and out's: token, head; the caches': block, slot, head), sizes, W.
    common = (*query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3],
              *value_cache.stride()[:3], block_tables.stride(0), block_size, head_size,
              sliding_window)  # fmt: skip
    tensors = (query, key_cache, value_cache, out, query_start_loc, seq_lens, block_tables)
    # The scales are read only from an fp8 cache.
    scales = (k_scale, v_scale) if kv_fp8 else (seq_lens, seq_lens)

    segment = config["decode_segment"]
    max_segments = triton.cdiv(max_seq_len, segment)
    # Workspace of the sequences split into segments (none when every decode fits one).
    split = (num_seqs, num_q_heads, max_segments) if max_segments > 1 else None
    floats = dict(dtype=torch.float32, device=query.device)
    partial = torch.empty((*split, block_d) if split else (1,), **floats)
    stats = torch.empty((*split, 2) if split else (1,), **floats)
    _decode_kernel[(num_seqs, num_kv_heads, max_segments)](
        *tensors,
        partial,
        stats,
        *scales,
        qk_scale,
        *common,
        max_segments,
        GROUP=group,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=config["decode_block_n"],
        BLOCK_D=block_d,
        SEGMENT=segment,
        KV_FP8=kv_fp8,
        SLIDING=sliding,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if max_segments > 1:
        _merge_segments_kernel[(num_seqs, num_q_heads)](
            out,
            query_start_loc,
            seq_lens,
            partial,
            stats,
            out.stride(0),
            out.stride(1),
            head_size,
            max_segments,
            sliding_window,
            BLOCK_S=triton.next_power_of_2(max_segments),
            BLOCK_D=block_d,
            SEGMENT=segment,
            SLIDING=sliding,
        )
    if max_query_len > 1:
        block_m = max(config["block_m"], triton.next_power_of_2(group))
        block_q = block_m // group
        # Sequence b's tiles start at query_start_loc[b] // block_q + b (see
        # _find_sequence), so this many tile numbers cover every sequence.
        num_tiles = num_tokens // block_q + num_seqs
        _prefill_kernel[(num_tiles, num_kv_heads)](
            *tensors,
            *scales,
            qk_scale,
            num_seqs,
            *common,
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=config["block_n"],
            BLOCK_D=block_d,
            KV_FP8=kv_fp8,
            SLIDING=sliding,
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
    return out
