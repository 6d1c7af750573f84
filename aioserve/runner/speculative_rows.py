"""A speculative step's sampling rows, and the drafts their samples confirm.

A chunk with drafts (`SequenceChunk.num_drafts`, engine/speculation.py) samples at each of
its last 1 + num_drafts positions: one sampling row each, in position order, where every
other sampling chunk has one row. Row j of such a chunk samples the sequence's token
number `num_sampled + j` as an ordinary decode would, its penalties counting the chunk's
first j drafts as output (`draft_counts`). Its draw confirms the draft at the next
position when it equals it; a chunk keeps the rows up to its first draw that does not
(`kept_rows`, on the device), so it keeps 1 to 1 + num_drafts tokens.

Its attention is that of 1 + num_drafts decodes (`attend_drafts_as_decodes`): token j
of the chunk is a query row of its own that reads the sequence up to itself, the keys and
values of the tokens before it in the chunk being written to the pool before any layer
reads it. A decode's attention reads the pool in place (on the CPU, decode_in_pool.py;
on a GPU, the split-KV decode kernel, and the padded decode graphs take the step), where
a chunk of a few query rows would gather its whole sequence as a prefill does in every
layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.attention import plan_attention
from aioserve.runner.sequence_slots import SlotTensors
from aioserve.runner.step_inputs import HostStepInputs, host_to_device
from aioserve.runner.step_plan import SequenceChunk

NO_DRAFT = -1  # a row whose draw confirms nothing: its chunk's last


@dataclass
class DraftRows:
    """The sampling rows of a step with drafts, on the host."""

    first_rows: np.ndarray  # [C] int64: each sampling chunk's first row
    chunk_of_row: np.ndarray  # [R] int64: each row's sampling chunk
    offsets: np.ndarray  # [R] int64: each row's index inside its chunk
    drafts: np.ndarray  # [R] int64: the draft each row's draw must equal, or NO_DRAFT

    @property
    def num_rows(self) -> int:
        return self.drafts.size

    def draft_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, token) pairs, one per draft before the row in its chunk: what its penalties
        count as output beyond what its sequence has sampled."""
        rows, tokens = [], []
        for row in np.flatnonzero(self.offsets).tolist():
            first = row - int(self.offsets[row])
            rows.extend([row] * (row - first))
            tokens.extend(self.drafts[first:row].tolist())
        return np.asarray(rows, dtype=np.int64), np.asarray(tokens, dtype=np.int64)


def draft_rows(chunks: list[SequenceChunk]) -> DraftRows | None:
    """The sampling rows of a step's sampling chunks (in batch order); None when no chunk
    has drafts (one row a chunk)."""
    sampling = [chunk for chunk in chunks if chunk.samples]
    if not any(chunk.num_drafts for chunk in sampling):
        return None
    counts = np.fromiter((1 + c.num_drafts for c in sampling), dtype=np.int64, count=len(sampling))
    first_rows = np.zeros(len(sampling), dtype=np.int64)
    np.cumsum(counts[:-1], out=first_rows[1:])
    chunk_of_row = np.repeat(np.arange(len(sampling)), counts)
    offsets = np.arange(int(counts.sum())) - first_rows[chunk_of_row]
    drafts = np.full(offsets.size, NO_DRAFT, dtype=np.int64)
    for chunk, first in zip(sampling, first_rows.tolist(), strict=True):
        if chunk.num_drafts:
            drafts[first : first + chunk.num_drafts] = chunk.token_ids[-chunk.num_drafts :]
    return DraftRows(first_rows, chunk_of_row, offsets, drafts)


def expand_logits_indices(logits_indices: np.ndarray, rows: DraftRows) -> np.ndarray:
    """The step's logits rows for `rows`: each chunk's last token's, preceded by those of
    its drafts' positions (the tokens before them in the step)."""
    last = logits_indices[rows.chunk_of_row]
    num_rows = np.diff(np.append(rows.first_rows, rows.num_rows))[rows.chunk_of_row]
    return last - (num_rows - 1 - rows.offsets)


def penalty_state_with_drafts(
    state: SlotTensors, slots: Tensor, rows: DraftRows, penalty_rows: np.ndarray
) -> tuple[Tensor, Tensor, Tensor]:
    """The output counts and prompt masks of the rows with penalties (`penalty_rows`), as
    [P, vocab] copies whose counts add the drafts before each row in its chunk, and the
    copy each row reads: its own, or for a row without penalties the first (which its
    neutral penalties leave unused)."""
    device = slots.device
    own_rows = slots[host_to_device(penalty_rows, device)]
    counts = state.output_counts[own_rows]
    copy_of_row = np.full(rows.num_rows, -1, dtype=np.int64)
    copy_of_row[penalty_rows] = np.arange(penalty_rows.size)
    draft_rows, draft_tokens = rows.draft_counts()
    copies = copy_of_row[draft_rows]
    counted = copies >= 0
    if counted.any():
        counts.index_put_(
            (
                host_to_device(copies[counted], device),
                host_to_device(draft_tokens[counted], device),
            ),
            torch.ones(int(counted.sum()), dtype=counts.dtype, device=device),
            accumulate=True,
        )
    state_rows = host_to_device(np.maximum(copy_of_row, 0), device)
    return counts, state.prompt_mask[own_rows], state_rows


def attend_drafts_as_decodes(
    inputs: HostStepInputs,
    chunks: list[SequenceChunk],
    block_size: int,
    device: torch.device,
) -> HostStepInputs:
    """`inputs` whose attention sees each chunk with drafts as one decode a token: the
    token order, positions, KV slots and logits rows stay; the query rows, their lengths
    and block tables are the decodes'. The step's attention is planned here."""
    query_lens = np.diff(inputs.query_start_loc).astype(np.int64)
    split = np.fromiter((c.num_drafts > 0 for c in chunks), dtype=bool, count=len(chunks))
    rows_per_chunk = np.where(split, query_lens, 1)
    chunk_of_row = np.repeat(np.arange(len(chunks)), rows_per_chunk)
    first_row = np.zeros(len(chunks), dtype=np.int64)
    np.cumsum(rows_per_chunk[:-1], out=first_row[1:])
    offsets = np.arange(chunk_of_row.size) - first_row[chunk_of_row]
    split_rows = split[chunk_of_row]
    row_lens = np.where(split_rows, 1, query_lens[chunk_of_row])
    query_start_loc = np.zeros(row_lens.size + 1, dtype=np.int32)
    np.cumsum(row_lens, out=query_start_loc[1:])
    chunk_lens = inputs.seq_lens[chunk_of_row].astype(np.int64)
    seq_lens = np.where(
        split_rows, chunk_lens - query_lens[chunk_of_row] + offsets + 1, chunk_lens
    ).astype(np.int32)
    block_tables = np.ascontiguousarray(inputs.block_tables[chunk_of_row])
    return replace(
        inputs,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=int(row_lens.max()),
        attention_plan=plan_attention(
            query_start_loc, seq_lens, block_tables, block_size, device, inputs.slot_mapping
        ),
    )


@dataclass
class KeptRows:
    """Which rows of a step with drafts keep their tokens, on the device."""

    num_kept: Tensor  # [C] int64: tokens each sampling chunk keeps (1 + drafts confirmed)
    last_rows: Tensor  # [C] int64: each chunk's last kept row
    kept: Tensor  # [R] int32: 1 on kept rows


def kept_rows(token_ids: Tensor, rows: DraftRows) -> KeptRows:
    """The rows each chunk keeps: up to its first row whose draw is not the draft after it."""
    device = token_ids.device
    drafts = host_to_device(rows.drafts, device)
    chunk_of_row = host_to_device(rows.chunk_of_row, device)
    first_rows = host_to_device(rows.first_rows, device)
    missed = (token_ids != drafts).to(torch.int64)  # the last row of a chunk always misses
    misses_before = torch.cumsum(missed, 0) - missed
    misses_before = misses_before - misses_before[first_rows][chunk_of_row]
    kept = (misses_before == 0).to(torch.int32)
    num_kept = torch.zeros(first_rows.numel(), dtype=torch.int64, device=device)
    num_kept.index_add_(0, chunk_of_row, kept.to(torch.int64))
    return KeptRows(num_kept, first_rows + num_kept - 1, kept)


def record_kept(
    state: SlotTensors,
    slots: Tensor,
    token_ids: Tensor,
    kept: KeptRows,
    rows: DraftRows,
    penalty_rows: Tensor | None,
) -> None:
    """SlotTensors.record_sampled for a step with drafts: each sequence's last kept token,
    and in the penalties' counts every kept one."""
    first_rows = host_to_device(rows.first_rows, token_ids.device)
    state.last_sampled[slots[first_rows]] = token_ids[kept.last_rows]
    if penalty_rows is not None:
        counts = state.output_counts
        counts.index_put_(
            (slots[penalty_rows], token_ids[penalty_rows]),
            kept.kept[penalty_rows].to(counts.dtype),
            accumulate=True,
        )
