"""A generative decoder served as an embedding model (vLLM's `--convert embed`): Qwen3-Embedding
and the other sentence-transformers models built on a *ForCausalLM.

The pooling runner (pooling_runner.py) hands its model a step of whole prompts packed one
after another, with their boundaries (`cu_seqlens`), as an encoder takes them. A decoder's
attention, though, is the paged one (models/paged_attention_op.py): it writes each layer's
keys and values into KV-cache blocks and reads the context back through block tables.
`DecoderAsEncoder` gives it that: a pool of its own, big enough for one step (every prompt
in blocks of its own, from the first), and each step's attention metadata, a prefill of
every prompt from position 0. Nothing is kept from one step to the next: the next step
writes over the same blocks. The hidden rows that come back are pooled as the pooler says
(LAST by default, as vLLM's converted models pool).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from aioserve.kernels.attention import plan_attention
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import step_context
from aioserve.runner.kv_memory import allocate_kv_caches

BLOCK_SIZE = 16  # a prompt wastes less than a block of the pool


class DecoderAsEncoder(nn.Module):
    """`forward(input_ids, positions, cu_seqlens, max_seqlen, token_type_ids)` of an encoder
    over a decoder `model` (causal attention within each prompt); `config` is the
    decoder's."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.decoder = model
        self.config = model.config
        self.device = device
        prompts = min(max_num_seqs, max_num_batched_tokens)
        num_blocks = -(-max_num_batched_tokens // BLOCK_SIZE) + prompts
        self.kv_caches, zeroing = allocate_kv_caches(
            model.config, num_blocks, BLOCK_SIZE, dtype, device
        )
        if zeroing is not None:
            zeroing.join()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        if token_type_ids is not None:
            raise ValueError("a decoder takes no token types (text pairs' segments)")
        with step_context(
            self._prefill_metadata(cu_seqlens.cpu().numpy(), max_seqlen), self.kv_caches
        ):
            return self.decoder(input_ids, positions)

    def _prefill_metadata(self, starts: np.ndarray, max_seqlen: int) -> AttentionMetadata:
        """Every prompt a prefill from position 0, in blocks of its own laid one after
        another."""
        lengths = np.diff(starts).astype(np.int32)
        num_blocks = -(-lengths // BLOCK_SIZE)
        first_blocks = np.concatenate(([0], np.cumsum(num_blocks)[:-1]))
        block_tables = np.zeros((len(lengths), int(num_blocks.max())), dtype=np.int32)
        for row, (first, count) in enumerate(zip(first_blocks, num_blocks, strict=True)):
            block_tables[row, :count] = np.arange(first, first + count)
        slot_mapping = np.concatenate(
            [
                first * BLOCK_SIZE + np.arange(n)
                for first, n in zip(first_blocks, lengths, strict=True)
            ]
        ).astype(np.int64)
        query_start_loc = starts.astype(np.int32)
        device = self.device
        plan = plan_attention(
            query_start_loc, lengths, block_tables, BLOCK_SIZE, device, slot_mapping
        )

        def on_device(array: np.ndarray) -> Tensor:
            return torch.from_numpy(array).to(device)

        return AttentionMetadata(
            slot_mapping=on_device(slot_mapping),
            query_start_loc=on_device(query_start_loc),
            seq_lens=on_device(lengths),
            block_tables=on_device(block_tables),
            max_query_len=max_seqlen,
            max_seq_len=max_seqlen,
            plan=plan,
            skips_kv_writes=False,
        )
