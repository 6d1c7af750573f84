"""What attention needs to know about one model step's flat batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioserve.kernels.attention_reference import ReferencePlan


@dataclass
class AttentionMetadata:
    """The layout of a step's tokens over sequences and KV-cache blocks.

    The step's T tokens are laid out sequence after sequence: sequence b owns rows
    `query_start_loc[b]:query_start_loc[b + 1]`. Each row's K/V is written to
    `slot_mapping[row]` (block id * block size + offset) before attention reads it back
    through `block_tables`. `plan` is the same layout digested by the attention path that
    runs (`plan_attention`), built once per step.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    plan: ReferencePlan | None = None
    skips_kv_writes: bool = True  # whether a slot may be -1 (no write); False: none is

    @classmethod
    def without_kv_writes(cls, num_tokens: int, device: torch.device) -> AttentionMetadata:
        """A step of `num_tokens` one-token sequences that writes no KV slot (slot -1): for
        steps run only to compile the model or to measure its memory."""
        return cls(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=device),
            block_tables=torch.zeros((num_tokens, 1), dtype=torch.int32, device=device),
            max_query_len=1,
            max_seq_len=1,
            skips_kv_writes=True,
        )
