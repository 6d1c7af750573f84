"""Turn a step plan into the tensors of one model step.

`build_host_inputs` runs while the step is prepared, on the host only (numpy): the step's
tokens are flattened sequence after sequence, each token gets its position and KV-cache
slot, and the sequences whose chunk samples get a logits row. A decode whose token the
host does not know yet (sampled by the step still running) gets a placeholder row, which
`HostStepInputs.to_device` fills from the device's record of the last sampled tokens.

`to_device` runs on the model thread, in step order: on a GPU each array goes through
pinned memory so that the copy is asynchronous; on the CPU the arrays are used in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from aioserve.kernels.attention import plan_attention
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.prompt_embeds import PromptEmbeds
from aioserve.runner.sequence_slots import SequenceSlots
from aioserve.runner.step_plan import SequenceChunk, StepPlan


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`; asynchronous through pinned memory on a GPU, no copy on the CPU."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: rows of the step whose logits are sampled
    embeds: PromptEmbeds | None = None  # rows given as embeddings instead of tokens


@dataclass
class HostStepInputs:
    input_ids: np.ndarray  # [T] int64; 0 in placeholder rows
    placeholder_rows: np.ndarray  # [P] int64: rows whose token is their sequence's last sample
    placeholder_slots: np.ndarray  # [P] int64: the slots of those sequences
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: np.ndarray  # [S] int64
    max_query_len: int
    max_seq_len: int
    attention_plan: object | None  # the attention backend's own per-step plan
    graph_size: int = 0  # the decode batch size it is padded to (decode_graphs.py); 0: none
    embeds: PromptEmbeds | None = None  # on the host

    def fill_placeholders(self, input_ids: torch.Tensor, last_sampled: torch.Tensor) -> None:
        """Write each placeholder row's token, its sequence's last sample, into `input_ids`
        (on the device, where `last_sampled` is)."""
        if self.placeholder_rows.size:
            device = input_ids.device
            rows = host_to_device(self.placeholder_rows, device)
            slots = host_to_device(self.placeholder_slots, device)
            input_ids[rows] = last_sampled[slots]

    def to_device(self, device: torch.device, last_sampled: torch.Tensor) -> StepInputs:
        input_ids = host_to_device(self.input_ids, device)
        self.fill_placeholders(input_ids, last_sampled)
        attention = AttentionMetadata(
            slot_mapping=host_to_device(self.slot_mapping, device),
            query_start_loc=host_to_device(self.query_start_loc, device),
            seq_lens=host_to_device(self.seq_lens, device),
            block_tables=host_to_device(self.block_tables, device),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            plan=self.attention_plan,
            skips_kv_writes=bool((self.slot_mapping < 0).any()),
        )
        embeds = None
        if self.embeds is not None:
            embeds = PromptEmbeds(
                self.embeds.rows.to(device, non_blocking=True),
                self.embeds.values.to(device, non_blocking=True),
            )
        return StepInputs(
            input_ids=input_ids,
            positions=host_to_device(self.positions, device),
            attention=attention,
            logits_indices=host_to_device(self.logits_indices, device),
            embeds=embeds,
        )


def build_host_inputs(
    plan: StepPlan,
    slots: SequenceSlots,
    block_size: int,
    device: torch.device,
    plans_attention: bool = True,
) -> tuple[HostStepInputs, np.ndarray]:
    """The step's inputs on the host, and the slot of each of its sequences (batch order).

    Without `plans_attention` the step gets no attention plan: its layers then plan their
    attention each, where they need one."""
    chunks = plan.chunks
    if len(chunks) == 1 and chunks[0].num_tokens == 1 and chunks[0].embeds is None:
        return one_token_inputs(chunks[0], slots, block_size, device, plans_attention)
    return chunks_inputs(chunks, slots, block_size, device, plans_attention)


def chunks_inputs(
    chunks: list[SequenceChunk],
    slots: SequenceSlots,
    block_size: int,
    device: torch.device,
    plans_attention: bool = True,
) -> tuple[HostStepInputs, np.ndarray]:
    """build_host_inputs of any step, in numpy calls over its chunks."""
    num_seqs = len(chunks)
    row_slots = np.empty(num_seqs, dtype=np.int64)
    for row, chunk in enumerate(chunks):
        slot = slots.slot(chunk.seq_id)
        slots.append_blocks(slot, chunk.new_block_ids)
        row_slots[row] = slot
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num_seqs)
    query_start_loc, positions, seq_of_token, query_lens, max_query_len = _token_layout(
        chunks, starts
    )
    seq_lens = starts + query_lens
    num_tokens = len(positions)

    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    block_tables = slots.block_tables[row_slots, :max_blocks]
    if np.any(slots.num_blocks[row_slots] * block_size < seq_lens):
        raise ValueError("a scheduled chunk reaches past its sequence's KV blocks")

    slot_mapping = (
        block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )

    input_ids = np.zeros(num_tokens, dtype=np.int64)
    placeholders = []
    for row, chunk in enumerate(chunks):
        begin = query_start_loc[row]
        if chunk.token_ids is None:
            if chunk.num_tokens != 1:
                raise ValueError("a chunk without token ids must be one decode token")
            placeholders.append(row)
        else:
            if len(chunk.token_ids) != chunk.num_tokens:
                raise ValueError(
                    f"chunk of {chunk.seq_id!r} has {len(chunk.token_ids)} token ids "
                    f"for {chunk.num_tokens} tokens"
                )
            input_ids[begin : begin + chunk.num_tokens] = chunk.token_ids
    placeholder_rows = np.asarray(placeholders, dtype=np.int64)
    embeds = _prompt_embeds(chunks, query_start_loc)

    sampled = [row for row, chunk in enumerate(chunks) if chunk.samples]
    query_start_loc = query_start_loc.astype(np.int32)
    seq_lens = seq_lens.astype(np.int32)
    host = HostStepInputs(
        input_ids=input_ids,
        placeholder_rows=query_start_loc[placeholder_rows].astype(np.int64),
        placeholder_slots=row_slots[placeholder_rows],
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=np.ascontiguousarray(block_tables),
        logits_indices=query_start_loc[1:][sampled].astype(np.int64) - 1,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        attention_plan=plan_attention(
            query_start_loc, seq_lens, block_tables, block_size, device, slot_mapping
        )
        if plans_attention
        else None,
        embeds=embeds,
    )
    return host, row_slots


def _prompt_embeds(chunks: list[SequenceChunk], query_start_loc: np.ndarray) -> PromptEmbeds | None:
    """The step's rows given as embeddings: each chunk's `embed_rows`, or its first rows."""
    rows, values = [], []
    for row, chunk in enumerate(chunks):
        if chunk.embeds is not None:
            begin = int(query_start_loc[row])
            if chunk.embed_rows is None:
                rows.append(torch.arange(begin, begin + chunk.embeds.shape[0]))
            else:
                rows.append(torch.from_numpy(chunk.embed_rows + begin))
            values.append(chunk.embeds)
    if not rows:
        return None
    return PromptEmbeds(torch.cat(rows), torch.cat(values))


def one_token_inputs(
    chunk: SequenceChunk,
    slots: SequenceSlots,
    block_size: int,
    device: torch.device,
    plans_attention: bool,
) -> tuple[HostStepInputs, np.ndarray]:
    """build_host_inputs of a step of one sequence's one token (a decode at one stream),
    worked out in Python integers: at one stream the host's work runs right after a model
    step has passed its weights through the CPU's caches, where each numpy call on a few
    elements costs microseconds of cold code, and the general path makes ~30 of them."""
    slot = slots.slot(chunk.seq_id)
    slots.append_blocks(slot, chunk.new_block_ids)
    position = chunk.start
    seq_len = position + 1
    blocks = -(-seq_len // block_size)
    if int(slots.num_blocks[slot]) < blocks:
        raise ValueError("a scheduled chunk reaches past its sequence's KV blocks")
    if chunk.token_ids is not None and len(chunk.token_ids) != 1:
        raise ValueError(
            f"chunk of {chunk.seq_id!r} has {len(chunk.token_ids)} token ids for 1 token"
        )
    # A copy: a view would keep the table's row stride, which a compiled graph guards on.
    block_tables = slots.block_tables[slot : slot + 1, :blocks].copy()
    slot_mapping = np.array(
        [int(block_tables[0, position // block_size]) * block_size + position % block_size],
        dtype=np.int64,
    )
    query_start_loc = np.array([0, 1], dtype=np.int32)
    seq_lens = np.array([seq_len], dtype=np.int32)
    placeholder = chunk.token_ids is None
    host = HostStepInputs(
        input_ids=np.array([0 if placeholder else chunk.token_ids[0]], dtype=np.int64),
        placeholder_rows=np.array([0] if placeholder else [], dtype=np.int64),
        placeholder_slots=np.array([slot] if placeholder else [], dtype=np.int64),
        positions=np.array([position], dtype=np.int64),
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=np.array([0] if chunk.samples else [], dtype=np.int64),
        max_query_len=1,
        max_seq_len=seq_len,
        attention_plan=plan_attention(
            query_start_loc, seq_lens, block_tables, block_size, device, slot_mapping
        )
        if plans_attention
        else None,
    )
    return host, np.array([slot], dtype=np.int64)


class _TokenLayout(NamedTuple):
    query_start_loc: np.ndarray  # [B + 1] int64: where each chunk's tokens start
    positions: np.ndarray  # [T] int64
    seq_of_token: np.ndarray  # [T] int64: each token's chunk
    query_lens: np.ndarray | int  # [B] int64, or 1 where every chunk is one token
    max_query_len: int


def _token_layout(chunks: list[SequenceChunk], starts: np.ndarray) -> _TokenLayout:
    """How the chunks' tokens are laid out in the step.

    A step of one-token chunks (decodes, at any batch size) is laid out with a few numpy
    calls: at one stream, after a model step has passed its weights through the CPU's
    caches, each numpy call costs tens of microseconds of cold code."""
    num_seqs = len(chunks)
    if all(c.num_tokens == 1 for c in chunks):
        rows = np.arange(num_seqs + 1)
        return _TokenLayout(rows, starts, rows[:-1], 1, 1)
    query_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    # Position of every token: its chunk's start plus its offset inside the chunk.
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (
        np.arange(query_start_loc[-1])
        - np.repeat(query_start_loc[:-1], query_lens)
        + starts[seq_of_token]
    )
    return _TokenLayout(query_start_loc, positions, seq_of_token, query_lens, int(query_lens.max()))
