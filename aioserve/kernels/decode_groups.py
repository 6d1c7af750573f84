"""A step's decoding sequences, grouped as the torch path of paged attention attends them.

Planned once a step from its host arrays (attention_reference.plan_reference_attention),
grouped in the step's first layer once it shows which path runs: weighed in the pool
(decode_in_pool.py: sorted by length, grouped as `group_decodes` says) or gathered
(DECODE_GROUP sequences at a time); in batch-invariant mode one sequence a group. Each
group works out, also once, what every layer reads alike: its bags over the pool (from its
host arrays, with numpy), its padding's positions, the pool rows its gathers copy. Its
arrays go to the device only where a path reads them there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels import decode_in_pool, dispatch
from aioserve.kernels.decode_in_pool import on_device

DECODE_GROUP = 16

IndexArray = TypeVar("IndexArray", Tensor, np.ndarray)


@dataclass
class DecodeGroup:
    """Decoding sequences attended together: their host arrays, and the same on the device
    once a path reads them (the bags over the pool are worked out from the host arrays)."""

    host_rows: np.ndarray  # [n] int64: each sequence's query row
    # [n, b] int64: the blocks each sequence reads, b its longest's (padded with the first)
    table: np.ndarray
    host_lengths: np.ndarray  # [n] int64: each sequence's length
    # [p, 2] int64: the (sequence, slot) pairs past their sequence's length, or before its
    # sliding window, among the `width` slots (the whole blocks where weighed in the pool,
    # as its scores are); None: none is.
    host_padding: np.ndarray | None
    # Slots each sequence's attention covers: the longest member's length where weighed in
    # the pool (its values) or a gathered group of one (cut to its length); else the
    # whole blocks.
    width: int
    first_row: int | None  # rows[0] when the rows are consecutive, else None
    device: torch.device
    # A group of one: the first slot its row sees (past a sliding window's masked start).
    first_slot: int = 0
    # Worked out in the step's first layer, once the heads and the pool are known.
    _head_rows: Tensor | None = None
    _head_padding: Tensor | None = None
    _bias: Tensor | None = None
    _bags: decode_in_pool.PoolBags | None = None

    @functools.cached_property
    def rows(self) -> Tensor:
        return on_device(self.host_rows, self.device)

    @functools.cached_property
    def blocks(self) -> Tensor:
        return on_device(self.table, self.device)

    @functools.cached_property
    def padding(self) -> Tensor | None:
        return None if self.host_padding is None else on_device(self.host_padding, self.device)

    def bias(self, dtype: torch.dtype, num_kv_heads: int) -> Tensor:
        """`dtype` [n * Hkv, 1, width], -inf at the padding and 0 elsewhere, a bias for the
        scores' product."""
        if self._bias is None:
            n = self.rows.numel()
            bias = torch.zeros((n, num_kv_heads, self.width), dtype=dtype, device=self.rows.device)
            if self.padding is not None:
                bias[self.padding[:, 0], :, self.padding[:, 1]] = float("-inf")
            self._bias = bias.view(n * num_kv_heads, 1, self.width)
        return self._bias

    def head_rows(self, num_kv_heads: int) -> Tensor:
        """[n * Hkv * blocks] int64: the rows of a head-major pool viewed as
        [num_blocks * Hkv, block_size * D] that hold the group's keys, sequence by sequence
        and head by head."""
        if self._head_rows is None:
            self._head_rows = pool_head_rows(self.blocks, num_kv_heads)
        return self._head_rows

    def head_padding(self, num_kv_heads: int) -> Tensor | None:
        """The padding slots as rows of the gathered [n * Hkv * width, D] keys."""
        if self.padding is None:
            return None
        if self._head_padding is None:
            self._head_padding = padded_positions(self.padding, num_kv_heads, self.width)
        return self._head_padding

    def bags(
        self, key_cache: Tensor, value_cache: Tensor, num_q_heads: int
    ) -> decode_in_pool.PoolBags:
        """The group's bags over the pool (decode_in_pool.pool_bags), its padding masked
        in the scores (padded_positions)."""
        if self._bags is None:
            scored_width = self.table.shape[1] * key_cache.shape[1]
            self._bags = decode_in_pool.pool_bags(
                self.table,
                self.host_lengths,
                self.width,
                key_cache,
                value_cache,
                num_q_heads,
                None
                if self.host_padding is None
                else padded_positions(self.host_padding, num_q_heads, scored_width),
            )
        return self._bags


def padded_positions(padding: IndexArray, num_heads: int, width: int) -> IndexArray:
    """Where the (sequence, slot) pairs of `padding` [p, 2] (a tensor or a host array) lie,
    for every head, in a tensor flattened from [n, heads, width, ...] over its first three
    dimensions: [p * heads]."""
    seq, slot = padding[:, :1], padding[:, 1:]
    if isinstance(padding, np.ndarray):
        heads = np.arange(num_heads)
    else:
        heads = torch.arange(num_heads, device=padding.device)
    return ((seq * num_heads + heads) * width + slot).reshape(-1)


@dataclass
class DecodeSequences:
    """A step's decoding sequences, from its host arrays, grouped for the path that attends
    them once the first layer shows which it is."""

    rows: np.ndarray  # each sequence's query row
    lengths: np.ndarray
    tables: np.ndarray  # [n, max_blocks] int64
    block_size: int
    device: torch.device
    # A sliding window W > 0: each row sees only the last W slots of its sequence (whose
    # blocks before the window are left out: `windowed`).
    window: int = 0
    _groups: dict[bool, list[DecodeGroup]] = field(default_factory=dict)
    _in_pool: bool | None = None

    def windowed(self, window: int) -> DecodeSequences:
        """The same rows through a sliding window of `window` slots: each sequence's blocks
        wholly before its window left out of its table and its length, the slots of its
        first kept block before the window masked as padding is."""
        skipped = np.maximum(self.lengths - window, 0) // self.block_size  # [n] blocks
        columns = np.arange(self.tables.shape[1] - int(skipped.min()))
        columns = np.minimum(skipped[:, None] + columns, self.tables.shape[1] - 1)
        return DecodeSequences(
            self.rows,
            self.lengths - skipped * self.block_size,
            np.take_along_axis(self.tables, columns, axis=1),
            self.block_size,
            self.device,
            window,
        )

    def read_in_place(self, key_cache: Tensor, value_cache: Tensor, dtype: torch.dtype) -> bool:
        """decode_in_pool.reads_in_place, asked in the step's first layer: every layer's
        pool has one layout and dtype (runner/kv_memory.py allocates them alike)."""
        if self._in_pool is None:
            self._in_pool = decode_in_pool.reads_in_place(key_cache, value_cache, dtype)
        return self._in_pool

    def groups(self, in_pool: bool, num_q_heads: int, head_size: int) -> list[DecodeGroup]:
        """In the pool (decode_in_pool.py): sorted by length, grouped as group_decodes says.
        Gathered: in step order, DECODE_GROUP at a time. Groups of one sequence in
        batch-invariant mode (dispatch.batch_invariant)."""
        if in_pool not in self._groups:
            count = len(self.rows)
            if dispatch.batch_invariant():
                members = [np.array([i]) for i in range(count)]
            elif in_pool:
                members = decode_in_pool.group_decodes(
                    self.lengths, self.block_size, num_q_heads, head_size
                )
            else:
                members = [
                    np.arange(i, min(i + DECODE_GROUP, count))
                    for i in range(0, count, DECODE_GROUP)
                ]
            self._groups[in_pool] = [self._group(seqs, in_pool) for seqs in members]
        return self._groups[in_pool]

    def _group(self, seqs: np.ndarray, in_pool: bool) -> DecodeGroup:
        lengths = self.lengths[seqs]
        blocks_per_seq = -(-lengths // self.block_size)
        width_blocks = int(blocks_per_seq.max())
        table = self.tables[seqs, :width_blocks]
        table = np.where(np.arange(width_blocks) < blocks_per_seq[:, None], table, table[:, :1])
        rows = self.rows[seqs]
        consecutive = bool((np.diff(rows) == 1).all())
        if in_pool or len(seqs) == 1:
            width = int(lengths.max())
        else:
            width = width_blocks * self.block_size
        # Weighed in the pool, the scores cover whole blocks (decode_in_pool.attend_in_pool).
        scored = np.arange(width_blocks * self.block_size if in_pool else width)
        past = scored >= lengths[:, None]
        first_slot = 0
        if self.window:
            before = np.maximum(lengths - self.window, 0)  # slots before each window
            if in_pool or len(seqs) > 1:
                past |= scored < before[:, None]
            else:  # a gathered group of one is cut to its window (_attend_decode_group)
                first_slot = int(before[0])
        return DecodeGroup(
            host_rows=rows,
            table=table,
            host_lengths=lengths.astype(np.int64),
            host_padding=np.argwhere(past) if past.any() else None,
            width=width,
            first_row=int(rows[0]) if consecutive else None,
            device=self.device,
            first_slot=first_slot,
        )


def pool_head_rows(blocks: Tensor, num_kv_heads: int) -> Tensor:
    """The rows of a head-major pool viewed as [num_blocks * Hkv, block_size * D] holding
    `blocks` [..., b]: [... * Hkv * b], head by head within each leading index."""
    heads = torch.arange(num_kv_heads, device=blocks.device).view(-1, 1)
    return (blocks.unsqueeze(-2) * num_kv_heads + heads).reshape(-1)
