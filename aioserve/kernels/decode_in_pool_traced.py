"""A decode row's KV write and attention in the pool, as torch ops a compiled graph traces.

decode_in_pool.py weighs the pool in place with two `embedding_bag`s a layer, called from
the attention's custom op (models/paged_attention_op.py), which runs Python between the
compiled code of every layer. This module writes the same computation with every size
taken from its input tensors, so that torch.compile can trace it into a graph of the whole
step (runner/one_row_step.py) whose C++ wrapper calls every op with no Python in between.
The pool rows the bags read are worked out by torch ops too (`rows_in_pool`), from the
step's block table and lengths, in the graph.

The bags have fixed sizes, so no offsets are passed: each sequence's scores cover its
blocks whole and so do its values, the slots past its length masked to -inf before the
softmax (from its length, in the graph) and their value rows pointing at its first slot
with weight zero (decode_in_pool.value_rows). A slot past the length may hold anything,
NaN included: its score is replaced, not added to, and its value row is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class RowsInPool:
    """Where a step's decode rows write their keys and values and which pool rows their
    attention weighs: one row per sequence, all of them as one bag group."""

    write_blocks: Tensor  # [n] int64: each row's slot, as block and offset in it
    write_offsets: Tensor  # [n] int64
    # decode_in_pool.key_rows and value_rows, shaped so that the block count (a compiled
    # graph's one dynamic size) is one dimension of each.
    key_rows: Tensor  # [n, Hq, blocks, D]
    value_rows: Tensor  # [n, Hq, blocks, block_size]
    lengths: Tensor  # [n, 1] int64: each sequence's length, the new row included


def rows_in_pool(
    block_tables: Tensor,
    seq_lens: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    num_q_heads: int,
) -> RowsInPool:
    """The inputs of `write_and_attend` for sequences of lengths `seq_lens` [n] whose
    blocks are the rows of `block_tables` [n, blocks], as many as the longest sequence
    needs: each writes its new row at its last slot, and the bags cover all those blocks
    (a shorter sequence's row must name blocks of the pool there, whose slots are masked).

    Torch ops on the step's own metadata, so that a compiled step works them out in its
    graph, once for all its layers (every layer's pool has the same layout): the pool rows
    of decode_in_pool.key_rows and value_rows, computed as they are there."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    # Each stride in rows of the pool viewed as rows (a key row holds a block's slots of one
    # component, a value row a slot's head_size values), so that the graph multiplies and
    # adds but never divides: inductor's vector code divides 64-bit integers a lane at a
    # time, which took ~9% of the one-row step when the rows were worked out as in
    # decode_in_pool (a starting offset divided by the row length).
    key_block, _, key_head, key_dim = _in_rows(key_cache.stride(), block_size)
    value_block, value_slot, value_head, _ = _in_rows(value_cache.stride(), head_size)
    device = key_cache.device
    tables = block_tables.long()
    n, blocks = tables.shape
    torch._check(blocks > 0)
    lengths = seq_lens.long()
    group = num_q_heads // num_kv_heads
    kv_heads = torch.arange(num_kv_heads, device=device).repeat_interleave(group)  # [Hq]
    dims = torch.arange(head_size, device=device)
    key_rows = (
        tables[:, None, :, None] * key_block
        + (kv_heads * key_head)[None, :, None, None]
        + dims * key_dim
    )  # [n, Hq, blocks, D]
    # Slot j of block b is the sequence's position b * block_size + j; one past its length
    # points at its first slot: its weight is zero, and a free slot might hold a NaN (0 *
    # NaN).
    offsets = torch.arange(block_size, device=device)
    positions = torch.arange(blocks, device=device)[:, None] * block_size + offsets
    valid = positions < lengths[:, None, None]  # [n, blocks, block_size]
    slot_rows = torch.where(
        valid,
        tables[:, :, None] * value_block + offsets * value_slot,
        tables[:, :1, None] * value_block,
    )
    write_blocks, write_offsets = last_slots(tables, lengths, block_size)
    return RowsInPool(
        write_blocks=write_blocks,
        write_offsets=write_offsets,
        key_rows=key_rows,
        value_rows=slot_rows[:, None] + (kv_heads * value_head)[None, :, None, None],
        lengths=lengths[:, None],
    )


def last_slots(tables: Tensor, lengths: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Each sequence's last slot, where its new row is written: the block [n] from its row
    of `tables` [n, blocks] and the offset in that block [n], for `lengths` [n] int64."""
    last = lengths - 1
    return tables.gather(1, (last // block_size)[:, None]).squeeze(1), last % block_size


def _in_rows(strides: tuple[int, ...], row_length: int) -> tuple[int, ...]:
    """`strides` in rows of `row_length` elements; every stride but the row's own is a
    multiple of it in the dense layouts decode_in_pool.reads_in_place accepts."""
    if any(stride % row_length for stride in strides if stride != 1):
        raise ValueError(f"a pool with strides {strides} is not made of rows of {row_length}")
    return tuple(stride // row_length for stride in strides)


def write_and_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    rows: RowsInPool,
    scale: float,
    sliding_window: int = 0,
) -> Tensor:
    """Write each row's key and value [n, Hkv, D] into its slot, then attend with its query
    [n, Hq, D] over its sequence: [n, Hq, D], the numbers of decode_in_pool.attend_in_pool.
    With a `sliding_window` W > 0 the slots before the last W are masked as those past the
    length are (the bags still read every block: a one-row step's graph keeps one shape)."""
    n, num_q_heads, head_size = query.shape
    block_size = key_cache.shape[1]
    key_cache[rows.write_blocks, rows.write_offsets] = key
    value_cache[rows.write_blocks, rows.write_offsets] = value
    blocks = rows.key_rows.shape[2]
    torch._check(blocks > 0)
    torch._check(rows.value_rows.shape[2] == blocks)
    slots = blocks * block_size
    weights = torch.mul(query.unsqueeze(2).expand(n, num_q_heads, blocks, head_size), scale)
    scores = F.embedding_bag(
        rows.key_rows.flatten(0, 2),
        _rows(key_cache, block_size),
        mode="sum",
        per_sample_weights=weights.flatten(0, 2),
    )
    scores = scores.view(n, num_q_heads, blocks, block_size).flatten(2)
    positions = torch.arange(slots, device=query.device)
    hidden = positions >= rows.lengths  # [n, slots]
    if sliding_window:
        hidden |= positions < rows.lengths - sliding_window
    scores = scores.masked_fill(hidden.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # float32 inside, rounded to the pool's dtype
    out = F.embedding_bag(
        rows.value_rows.flatten(0, 1).flatten(1),
        _rows(value_cache, head_size),
        mode="sum",
        per_sample_weights=probs.flatten(0, 1),
    )
    return out.view(n, num_q_heads, head_size)


def _rows(cache: Tensor, row_length: int) -> Tensor:
    """decode_in_pool.stored_rows without reading the storage offset, which dynamo cannot
    trace (as_strided keeps the cache's own offset)."""
    return cache.as_strided((cache.numel() // row_length, row_length), (row_length, 1))
