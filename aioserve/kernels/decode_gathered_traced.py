"""A decode row's KV write and attention over its gathered blocks, as torch ops a compiled
graph traces: the float32 form of decode_in_pool_traced.py on a CPU with AVX-512.

There a float32 pool is not weighed in place: `embedding_bag` (what decode_in_pool.py
weighs a pool with) left MKL's float32 batched products 2.6× slower for the rest of the
process once it had run on an AVX-512 EPYC (kv_cache.decodes_weigh_in_place). Here each
sequence's blocks are gathered whole, as the layer graphs' path does
(attention_reference.py), and its query heads multiplied with them: two small products a
layer, inside the graph of the whole step (runner/one_row_step.py), so that its C++
wrapper calls every op with no Python in between.

The gather covers every block of the block table, as wide as the longest sequence needs.
A slot past a sequence's length (or before a sliding window's start) may hold anything,
NaN included: its score is replaced by -inf and its gathered value by zero.
The products are torch's (MKL's), as the gathered path's: written as multiply-reduces
for inductor to generate, the one-row step of SmolLM2 took 22.5 ms a token on an AVX2
EPYC against 18.2, and through SDPA (a mask for the slots not seen) 22.5 too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels.decode_in_pool_traced import last_slots


@dataclass
class GatheredBlocks:
    """Where a step's decode rows write their keys and values and which blocks their
    attention gathers: one row per sequence."""

    write_blocks: Tensor  # [n] int64: each row's slot, as block and offset in it
    write_offsets: Tensor  # [n] int64
    block_tables: Tensor  # [n, blocks] int64: the blocks each row attends over
    lengths: Tensor  # [n, 1] int64: each sequence's length, the new row included


def gathered_blocks(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> GatheredBlocks:
    """The inputs of `write_and_attend_gathered` for sequences of lengths `seq_lens` [n]
    whose blocks are the rows of `block_tables` [n, blocks]: each writes its new row at its
    last slot and attends over all those blocks. Torch ops, worked out once a step in its
    graph for all its layers."""
    tables = block_tables.long()
    torch._check(tables.shape[1] > 0)
    lengths = seq_lens.long()
    write_blocks, write_offsets = last_slots(tables, lengths, block_size)
    return GatheredBlocks(
        write_blocks=write_blocks,
        write_offsets=write_offsets,
        block_tables=tables,
        lengths=lengths[:, None],
    )


def write_and_attend_gathered(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    blocks: GatheredBlocks,
    scale: float,
    sliding_window: int = 0,
) -> Tensor:
    """Write each row's key and value [n, Hkv, D] into its slot of the pool ([num_blocks,
    block_size, Hkv, D], any layout), then attend with its query [n, Hq, D] over its
    sequence: [n, Hq, D], computed in the query's dtype. With a `sliding_window` W > 0 the
    slots before the last W are masked as those past the length are."""
    n, num_q_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    key_cache[blocks.write_blocks, blocks.write_offsets] = key
    value_cache[blocks.write_blocks, blocks.write_offsets] = value
    width = blocks.block_tables.shape[1]
    torch._check(width > 0)
    slots = width * block_size
    positions = torch.arange(slots, device=query.device)
    seen = positions < blocks.lengths  # [n, slots]; [*batch, 1, slots] below
    if sliding_window:
        seen &= positions >= blocks.lengths - sliding_window

    # A product per kv head of a row, its batch dimension left out where it is one (one kv
    # head), and every operand made in the products' shape, not viewed into it: inductor
    # failed to lower products over such views, their size (the slot count) unbacked.
    batch = (n * num_kv_heads,) if n * num_kv_heads > 1 else ()
    seen = seen[:, None, :].expand(n, num_kv_heads, slots).reshape(*batch, 1, slots)

    def gathered(cache: Tensor) -> Tensor:  # [*batch, slots, D]
        whole = cache[blocks.block_tables].permute(0, 3, 1, 2, 4)  # [n, Hkv, width, bs, D]
        return whole.reshape(*batch, slots, head_size)

    # A kv head's query heads (consecutive, as in the model) are the rows of its products.
    rows = query.reshape(*batch, num_q_heads // num_kv_heads, head_size)
    scores = torch.matmul(rows, gathered(key_cache).transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    values = gathered(value_cache).masked_fill(~seen.transpose(-1, -2), 0)
    out = torch.matmul(probs, values)
    return out.reshape(n, num_q_heads, head_size)
