"""Turn a scheduler decision into the tensors of one model step (CPU work, no device sync).

The step's tokens are flattened sequence after sequence. For each sequence the chunk's
token ids and positions are laid out, each token gets its KV-cache slot, and the
sequences whose chunk reaches the end of their known tokens get a logits row and a
sampling row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from aioserve.engine.scheduler import SchedulerOutput
from aioserve.kernels import dispatch
from aioserve.kernels.attention_reference import plan_reference_attention
from aioserve.models.attention_metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the step whose logits are sampled
    sampling_request_ids: list[str]  # the S sampled sequences, in logits row order


def build_step_inputs(
    output: SchedulerOutput,
    block_table_of: Callable[[str], list[int]],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    chunks = output.chunks
    num_seqs = len(chunks)
    query_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((c.num_computed_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    tables = [block_table_of(c.request.request_id) for c in chunks]
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table

    # Position of every token: its chunk's start plus its offset inside the chunk.
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (
        np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens) + starts[seq_of_token]
    )
    slot_mapping = (
        block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )

    input_ids = np.empty(num_tokens, dtype=np.int64)
    for chunk, begin, end in zip(chunks, query_start_loc[:-1], query_start_loc[1:], strict=True):
        start = chunk.num_computed_tokens
        input_ids[begin:end] = chunk.request.token_ids_range(start, start + chunk.num_tokens)

    sampled = [i for i, c in enumerate(chunks) if c.samples]
    logits_indices = query_start_loc[1:][sampled] - 1

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    attention = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(block_tables, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    if not dispatch.use_triton():
        attention.reference_plan = plan_reference_attention(
            attention.query_start_loc, attention.seq_lens, attention.block_tables, block_size
        )
    return StepInputs(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attention=attention,
        logits_indices=to_device(np.asarray(logits_indices, dtype=np.int64), torch.int64),
        sampling_request_ids=[chunks[i].request.request_id for i in sampled],
    )
