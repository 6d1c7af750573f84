"""A decode row's KV write and attention in the pool, as torch ops a compiled graph traces.

decode_in_pool.py weighs the pool in place with two `embedding_bag`s a layer, called from
the attention's custom op (models/paged_attention_op.py), which runs Python between the
compiled code of every layer. This module writes the same computation with every size
taken from its input tensors, so that torch.compile can trace it into a graph of the whole
step (runner/one_row_step.py) whose C++ wrapper calls every op with no Python in between.

The bags have fixed sizes, so no offsets are passed: each sequence's scores cover its
blocks whole and so do its values, the slots past its length masked to -inf before the
softmax (from its length, in the graph) and their value rows pointing at its first slot
with weight zero (decode_in_pool.value_rows). A slot past the length may hold anything,
NaN included: its score is replaced, not added to, and its value row is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import decode_in_pool


@dataclass
class RowsInPool:
    """Where a step's decode rows write their keys and values and which pool rows their
    attention weighs: one row per sequence, all of them as one bag group."""

    write_blocks: Tensor  # [n] int64: each row's slot, as block and offset in it
    write_offsets: Tensor  # [n] int64
    # decode_in_pool.key_rows and value_rows, shaped so that the block count is one
    # dimension of each (which a compiled graph takes as its one dynamic size).
    key_rows: Tensor  # [n, Hq, blocks, D]
    value_rows: Tensor  # [n, Hq, blocks, block_size]
    lengths: Tensor  # [n, 1] int64: each sequence's length, the new row included


def rows_in_pool(
    block_tables: np.ndarray,
    lengths: np.ndarray,
    key_cache: Tensor,
    value_cache: Tensor,
    num_q_heads: int,
) -> RowsInPool:
    """The inputs of `write_and_attend` for sequences of `lengths` [n] whose blocks are the
    rows of `block_tables` [n, >= blocks] (host arrays): each writes its new row at its
    last slot, and the bags cover the longest sequence's blocks (a shorter one's row must
    name blocks of the pool there, whose slots are masked)."""
    block_size = key_cache.shape[1]
    blocks = int(-(-lengths.max() // block_size))
    tables = block_tables[:, :blocks].astype(np.int64)
    last = lengths - 1
    n, head_size = len(lengths), key_cache.shape[3]
    keys = decode_in_pool.key_rows(tables, key_cache, num_q_heads)
    values = decode_in_pool.value_rows(
        tables, lengths, blocks * block_size, value_cache, num_q_heads
    )
    keys = keys.reshape(n, num_q_heads, blocks, head_size)
    values = values.reshape(n, num_q_heads, blocks, block_size)
    device = key_cache.device
    return RowsInPool(
        write_blocks=decode_in_pool.on_device(tables[np.arange(n), last // block_size], device),
        write_offsets=decode_in_pool.on_device((last % block_size).astype(np.int64), device),
        key_rows=decode_in_pool.on_device(keys, device),
        value_rows=decode_in_pool.on_device(values, device),
        lengths=decode_in_pool.on_device(lengths.astype(np.int64).reshape(-1, 1), device),
    )


def write_and_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    rows: RowsInPool,
    scale: float,
) -> Tensor:
    """Write each row's key and value [n, Hkv, D] into its slot, then attend with its query
    [n, Hq, D] over its sequence: [n, Hq, D], the numbers of decode_in_pool.attend_in_pool."""
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
    past_end = torch.arange(slots, device=query.device) >= rows.lengths  # [n, slots]
    scores = scores.masked_fill(past_end.unsqueeze(1), float("-inf"))
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
