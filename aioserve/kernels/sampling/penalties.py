"""Sampling steps 2-3: logit bias (and -inf bans), then vLLM's repetition, frequency and
presence penalties, over float32 logits."""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.sampling.common import SamplingBatch, _launch_config, _rows
from aioserve.kernels.triton_compat import tl, triton


@triton.jit
def _penalize(
    x,
    cols,
    mask,
    counts_row,
    prompt_row,
    presence,
    frequency,
    repetition,
    HAS_COUNTS: tl.constexpr,
    HAS_PROMPT_MASK: tl.constexpr,
):
    if HAS_COUNTS:
        counts = tl.load(counts_row + cols, mask=mask, other=0)
        seen = counts > 0
        if HAS_PROMPT_MASK:
            seen = seen | (tl.load(prompt_row + cols, mask=mask, other=0) != 0)
    else:
        seen = tl.load(prompt_row + cols, mask=mask, other=0) != 0
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    if HAS_COUNTS:
        x = x - frequency * counts.to(tl.float32)
        x = x - presence * (counts > 0).to(tl.float32)
    return x


@triton.jit
def _penalties_kernel(
    logits_ptr,
    out_ptr,
    counts_ptr,
    prompt_mask_ptr,
    state_rows_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    vocab_size,
    stride_logits,
    stride_out,
    stride_counts,
    stride_prompt,
    HAS_COUNTS: tl.constexpr,
    HAS_PROMPT_MASK: tl.constexpr,
    HAS_STATE_ROWS: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A float32 copy of each row, penalized when HAS_PENALTIES (in place when out is the
    logits)."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    out_row = out_ptr + row * stride_out
    if HAS_STATE_ROWS:
        state_row = tl.load(state_rows_ptr + row)
    else:
        state_row = row
    counts_row = counts_ptr + state_row * stride_counts
    prompt_row = prompt_mask_ptr + state_row * stride_prompt
    presence = tl.load(presence_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_PENALTIES:
            x = _penalize(
                x,
                cols,
                mask,
                counts_row,
                prompt_row,
                presence,
                frequency,
                repetition,
                HAS_COUNTS,
                HAS_PROMPT_MASK,
            )
        tl.store(out_row + cols, x, mask=mask)


@triton.jit
def _bias_kernel(
    out_ptr,
    bias_ids_ptr,
    bias_values_ptr,
    vocab_size,
    num_bias,
    stride_out,
    stride_bias,
    BLOCK_BIAS: tl.constexpr,
):
    """Each row's bias pairs added to its float32 logits, atomically, so that a token
    listed twice gets both values."""
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row * stride_out
    for start in range(0, num_bias, BLOCK_BIAS):
        entries = start + tl.arange(0, BLOCK_BIAS)
        in_row = entries < num_bias
        ids = tl.load(bias_ids_ptr + row * stride_bias + entries, mask=in_row, other=-1)
        values = tl.load(bias_values_ptr + row * stride_bias + entries, mask=in_row, other=0.0)
        valid = in_row & (ids >= 0) & (ids < vocab_size)
        tl.atomic_add(out_row + ids, values, mask=valid)


def _needs_processing(batch: SamplingBatch) -> bool:
    """Whether the logits change before the draw (a bitmask writes into the copy made here)."""
    return (
        batch.output_token_counts is not None
        or batch.prompt_token_mask is not None
        or batch.bias_token_ids is not None
        or batch.token_bitmask is not None
    )


def apply_bias_and_penalties_triton(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The Triton path of `apply_bias_and_penalties`."""
    logits = _rows(logits)
    num_rows, vocab_size = logits.shape
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    counts, prompt_mask = batch.output_token_counts, batch.prompt_token_mask
    bias_ids, bias_values = batch.bias_token_ids, batch.bias_values
    counts = _rows(counts) if counts is not None else None
    prompt_mask = _rows(prompt_mask) if prompt_mask is not None else None
    if bias_ids is not None:
        bias_ids, bias_values = bias_ids.contiguous(), bias_values.contiguous()
    num_bias = bias_ids.shape[1] if bias_ids is not None else 0
    has_penalties = counts is not None or prompt_mask is not None
    # The bias comes before the penalties. Without one, one launch copies and penalizes.
    # With one: copy, add the bias, then penalize in place, each its own launch. Stores
    # and atomics of one launch on the same address are not ordered by a barrier on ROCm
    # (s_barrier does not wait for global stores), so the copy and the bias that lands on
    # it must be separate launches, which the device runs in order.
    _launch_penalties(logits, out, batch, counts, prompt_mask, has_penalties and not num_bias)
    if num_bias:
        _bias_kernel[(num_rows,)](
            out,
            bias_ids,
            bias_values,
            vocab_size,
            num_bias,
            out.stride(0),
            bias_ids.stride(0),
            BLOCK_BIAS=min(triton.next_power_of_2(num_bias), 1024),
        )
        if has_penalties:
            _launch_penalties(out, out, batch, counts, prompt_mask, True)
    return out


def _launch_penalties(
    logits: Tensor,
    out: Tensor,
    batch: SamplingBatch,
    counts: Tensor | None,
    prompt_mask: Tensor | None,
    penalize: bool,
) -> None:
    vocab_size = logits.shape[1]
    block, num_warps = _launch_config(vocab_size)
    _penalties_kernel[(logits.shape[0],)](
        logits,
        out,
        counts if counts is not None else out,
        prompt_mask if prompt_mask is not None else out,
        batch.state_rows if batch.state_rows is not None else out,
        batch.presence_penalty,
        batch.frequency_penalty,
        batch.repetition_penalty,
        vocab_size,
        logits.stride(0),
        out.stride(0),
        counts.stride(0) if counts is not None else 0,
        prompt_mask.stride(0) if prompt_mask is not None else 0,
        HAS_COUNTS=counts is not None,
        HAS_PROMPT_MASK=prompt_mask is not None,
        HAS_STATE_ROWS=batch.state_rows is not None,
        HAS_PENALTIES=penalize,
        BLOCK=block,
        num_warps=num_warps,
        # No fused multiply-add: `x - penalty * count` rounds as the reference's does.
        enable_fp_fusion=False,
    )


def apply_bias_and_penalties_reference(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The torch path of `apply_bias_and_penalties`."""
    x = logits.float()
    vocab_size = x.shape[1]
    counts, prompt_mask = batch.output_token_counts, batch.prompt_token_mask
    if batch.bias_token_ids is None and counts is None and prompt_mask is None:
        return x
    x = x.clone()
    if batch.bias_token_ids is not None:
        ids, values = batch.bias_token_ids, batch.bias_values
        rows, entries = ((ids >= 0) & (ids < vocab_size)).nonzero(as_tuple=True)
        x.index_put_((rows, ids[rows, entries]), values[rows, entries], accumulate=True)
    if counts is None and prompt_mask is None:
        return x
    if batch.state_rows is not None:
        counts = counts[batch.state_rows] if counts is not None else None
        prompt_mask = prompt_mask[batch.state_rows] if prompt_mask is not None else None
    # Penalties change only the tokens seen in the prompt or the output, so only those are
    # computed (the kernel's arithmetic leaves the others as they are).
    seen = counts > 0 if counts is not None else prompt_mask
    if counts is not None and prompt_mask is not None:
        seen = seen | prompt_mask
    rows, cols = seen.nonzero(as_tuple=True)
    v = x[rows, cols]
    repetition = batch.repetition_penalty[rows]
    v = torch.where(v > 0, v / repetition, v * repetition)
    if counts is not None:
        count = counts[rows, cols]
        v = v - batch.frequency_penalty[rows] * count.float()
        v = v - batch.presence_penalty[rows] * (count > 0).float()
    x[rows, cols] = v
    return x


def apply_bias_and_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 2-3: float32 logits with the logit bias added, then the penalties applied."""
    if dispatch.use_triton():
        return apply_bias_and_penalties_triton(logits, batch)
    return apply_bias_and_penalties_reference(logits, batch)
