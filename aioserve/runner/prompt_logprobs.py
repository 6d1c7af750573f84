"""Prompt logprobs: how likely the model found each prompt token, from the prefill itself.

A sequence whose sampling asks for `prompt_logprobs` keeps its prompt in its slot. When a
chunk of that prompt runs, the hidden state at position p predicts the prompt token at
p + 1, so every position of the chunk but the prompt's last gets a row: the hidden
states go through the output head a slice at a time (a chunk of a few thousand tokens
would otherwise need gigabytes of logits), and `compute_logprobs`, the sampler's own
kernel, gives the target token's raw logprob, its rank and the top n. As in vLLM, prompt
tokens go through no logits processing, so the logprobs modes only choose between the
log-softmax (raw_/processed_logprobs) and the float32 logits themselves
(raw_/processed_logits).

The result names, per sequence, the position of the first prompt token scored and one
`TokenLogprobs` per token; a prompt computed again after a preemption is scored again,
and the engine keeps the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.sampling import LogprobsTensors, compute_logprobs
from aioserve.models.linear import SMALL_BATCH_ROWS
from aioserve.runner.compiled_step import ModelStep
from aioserve.runner.sequence_slots import SequenceSlots
from aioserve.runner.step_inputs import host_to_device
from aioserve.runner.step_plan import StepPlan, TokenLogprobs

# Rows of hidden states put through the output head at once: at most SMALL_BATCH_ROWS, so
# that the head's graph compiled for a decode batch serves (no compile while serving), and
# 128 × SmolLM2's 49,152-token vocabulary is 25 MB of float32 logits.
_ROWS_PER_SLICE = SMALL_BATCH_ROWS


@dataclass
class PromptSpan:
    seq_id: str
    first_position: int  # of the first prompt token scored
    num_tokens: int
    num_top: int


@dataclass
class HostPromptLogprobs:
    rows: np.ndarray  # [R] int64: rows of the step's hidden states
    targets: np.ndarray  # [R] int64: the prompt token each row predicts
    spans: list[PromptSpan]  # in row order
    num_top: int  # the most top logprobs a span wants


def plan_prompt_logprobs(
    plan: StepPlan, slots: SequenceSlots, query_start_loc: np.ndarray
) -> HostPromptLogprobs | None:
    """The step's prompt-logprob rows, or None when no chunk of the step asks for any."""
    if not slots.any_prompt_logprobs:  # every step goes through here: the common case first
        return None
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    spans: list[PromptSpan] = []
    for index, chunk in enumerate(plan.chunks):
        prompt = slots.prompt_for_logprobs(chunk.seq_id)
        if prompt is None or chunk.token_ids is None:
            continue
        # Positions start..end-1 predict the tokens at start+1..end, within the prompt.
        end = min(chunk.start + chunk.num_tokens, len(prompt) - 1)
        if end <= chunk.start:
            continue
        first_row = int(query_start_loc[index])
        rows.append(np.arange(first_row, first_row + end - chunk.start, dtype=np.int64))
        targets.append(prompt[chunk.start + 1 : end + 1])
        num_top = slots.settings[slots.slot(chunk.seq_id)].prompt_logprobs
        spans.append(PromptSpan(chunk.seq_id, chunk.start + 1, end - chunk.start, num_top))
    if not spans:
        return None
    return HostPromptLogprobs(
        rows=np.concatenate(rows),
        targets=np.concatenate(targets),
        spans=spans,
        num_top=max(span.num_top for span in spans),
    )


@torch.inference_mode()
def compute_prompt_logprobs(
    model_step: ModelStep,
    hidden: Tensor,
    host: HostPromptLogprobs,
    device: torch.device,
    logprobs_mode: str = "raw_logprobs",
) -> LogprobsTensors:
    """The logprobs of every row's target token, and the top `host.num_top`, by slices."""
    rows = host_to_device(host.rows, device)
    targets = host_to_device(host.targets, device)
    parts = [
        compute_logprobs(
            model_step.logits(hidden[rows[i : i + _ROWS_PER_SLICE]]),
            targets[i : i + _ROWS_PER_SLICE],
            host.num_top,
            normalized=logprobs_mode.endswith("_logprobs"),
        )
        for i in range(0, rows.numel(), _ROWS_PER_SLICE)
    ]
    return LogprobsTensors(
        sampled_logprob=torch.cat([p.sampled_logprob for p in parts]),
        sampled_rank=torch.cat([p.sampled_rank for p in parts]),
        top_token_ids=torch.cat([p.top_token_ids for p in parts]),
        top_logprobs=torch.cat([p.top_logprobs for p in parts]),
    )


def collect_prompt_logprobs(
    host: HostPromptLogprobs, tensors: LogprobsTensors
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Per sequence: the position of its first scored prompt token and the logprobs."""
    logprob = tensors.sampled_logprob.tolist()
    rank = tensors.sampled_rank.tolist()
    top_ids = tensors.top_token_ids.tolist()
    top_values = tensors.top_logprobs.tolist()
    result: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    row = 0
    for span in host.spans:
        entries = [
            TokenLogprobs(
                logprob[r], rank[r], top_ids[r][: span.num_top], top_values[r][: span.num_top]
            )
            for r in range(row, row + span.num_tokens)
        ]
        result[span.seq_id] = (span.first_position, entries)
        row += span.num_tokens
    return result
