"""The seam between engine and runner: one step described in plain data, and its result.

The engine's scheduler decides a step; it hands the runner a `StepPlan` and gets back a
`StepResult`. Nothing else crosses: the runner never sees a live request, never calls the
KV-cache manager, and keeps what it needs from step to step (block tables, sampling
settings, tokens sampled but not yet seen by the host) in its own per-sequence slots.

A sequence enters the runner with a `NewSequence` (when admitted, or re-admitted after a
preemption) and leaves it through `StepPlan.finished_seq_ids`. Each step lists, in batch
order, one `SequenceChunk` per scheduled sequence: which tokens to compute and where their
KV goes. With asynchronous scheduling the engine plans step N+1 before it knows the tokens
step N samples; a decode of such a token says so (`token_ids=None`) and the runner takes
it from its own record of step N's samples, on the device.

A step with structured-output rows carries their allowed-token masks (`TokenBitmask`),
which the engine fills once it knows every token sampled before the step: with
asynchronous scheduling, while the step's forward pass already runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from aioserve.models.lora_adapter import LoRAAdapter


@dataclass(frozen=True)
class SamplingSettings:
    """How one sequence samples, fixed for its life in the runner."""

    temperature: float  # below 1e-5: greedy
    top_k: int  # <= 0: no top-k
    top_p: float
    min_p: float
    seed: int  # every sequence has one (the engine draws it for unseeded requests)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None  # every other token is banned
    min_tokens: int = 0
    min_tokens_banned_ids: tuple[int, ...] = ()  # banned while fewer than min_tokens are out
    logprobs: int | None = None  # top logprobs wanted per token; None: no logprobs
    # The tokens whose logprobs each position reports instead of the top ones (logprobs 0).
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token; None: none
    thinking_token_budget: int | None = None  # runner/thinking_budget.py; None: no budget

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class NewSequence:
    """A sequence entering the runner: everything about it that does not change per step."""

    seq_id: str
    prompt_token_ids: list[int]  # what penalties count: none for a prompt of embeddings
    output_token_ids: list[int]  # sampled before a preemption: penalties count them
    sampling: SamplingSettings
    token_type_ids: list[int] | None = None  # a pooling prompt's segments (a BERT pair)
    lora_id: int = 0  # its LoRA adapter's id (0: none), the same id for the same weights
    lora_adapter: LoRAAdapter | None = None  # that adapter's weights, on the host
    # The request's SamplingParams as the caller gave them, for custom logits processors
    # (runner/custom_logits.py), which read them (their extra_args); the runner does not.
    params: object = None


@dataclass
class SequenceChunk:
    """One sequence's share of a step: tokens start..start+num_tokens of its sequence."""

    seq_id: str
    start: int  # position of the chunk's first token (tokens before it are in the KV cache)
    num_tokens: int
    token_ids: list[int] | None  # None: one token, the one sampled for it in the last step
    new_block_ids: list[int]  # KV blocks appended to the sequence's block table this step
    samples: bool  # the chunk ends at the sequence's last token: a token is sampled
    # Its last num_drafts tokens are drafts (speculative decoding): it samples at each of its
    # last 1 + num_drafts positions, and keeps the drafts its samples confirm.
    num_drafts: int = 0
    # Rows given as embeddings, taken in place of their tokens' embeddings: a prompt given
    # as embeddings (its first len(embeds) tokens, placeholders), or an image's features
    # (the rows `embed_rows` of the chunk); None: tokens throughout.
    embeds: torch.Tensor | None = None
    embed_rows: np.ndarray | None = None  # [len(embeds)] int64; None: the first rows


class TokenBitmask:
    """The tokens each structured-output row of a step may sample, filled by the engine.

    `rows` are sampling rows (one a sampling chunk, in batch order, and one more a draft
    for a chunk with drafts: speculative_rows.py); `words` holds one bitmask per row, bit
    t % 32 of int32 word t // 32 set for each allowed token t. The engine fills `words`,
    then calls `set_ready`; the runner calls `wait_ready` just before it samples. `abandon` (the engine stopped) makes the wait raise instead.
    """

    def __init__(self, rows: list[int], vocab_size: int) -> None:
        self.rows = np.asarray(rows, dtype=np.int64)
        self.words = np.empty((len(rows), -(-vocab_size // 32)), dtype=np.int32)
        self._ready = threading.Event()
        self._abandoned = False

    def set_ready(self) -> None:
        self._ready.set()

    def abandon(self) -> None:
        self._abandoned = True
        self._ready.set()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self) -> None:
        self._ready.wait()
        if self._abandoned:
            raise RuntimeError("the step's structured-output masks were never filled")


@dataclass
class StepPlan:
    new_sequences: list[NewSequence]  # entering the runner before this step
    chunks: list[SequenceChunk]  # the step's batch, in order
    finished_seq_ids: list[str]  # left since the last plan: the runner forgets them first
    token_bitmask: TokenBitmask | None = None  # the structured-output rows' masks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class TokenLogprobs:
    """Raw logprobs around one sampled token: its own, its rank, and the top-n."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepResult:
    sampled: dict[str, list[int]]  # sequence id -> tokens sampled this step
    logprobs: dict[str, list[TokenLogprobs]]  # only for sequences that asked
    # Sequence id -> (position of the first prompt token scored, one entry per token from
    # there): for sequences that asked, whose prompt ran in this step.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Sequence id -> its pooled hidden states (float32, 1-D, on the CPU): the pooling
    # sequences whose prompt ran in this step (a pooling runner's steps).
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
