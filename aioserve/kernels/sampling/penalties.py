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
def _bias_penalties_kernel(
    logits_ptr,
    out_ptr,
    counts_ptr,
    prompt_mask_ptr,
    state_rows_ptr,
    bias_ids_ptr,
    bias_values_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    vocab_size,
    num_bias,
    stride_logits,
    stride_out,
    stride_counts,
    stride_prompt,
    stride_bias,
    HAS_COUNTS: tl.constexpr,
    HAS_PROMPT_MASK: tl.constexpr,
    HAS_STATE_ROWS: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_BIAS: tl.constexpr,
):
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

    # The bias comes before the penalties. Without a bias one pass does everything;
    # with one, the float32 copy is written first, the bias is scattered into it
    # (atomically, so a token listed twice gets both values), then the penalties.
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_PENALTIES and not HAS_BIAS:
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

    if HAS_BIAS:
        tl.debug_barrier()
        for start in range(0, num_bias, BLOCK_BIAS):
            entries = start + tl.arange(0, BLOCK_BIAS)
            in_row = entries < num_bias
            ids = tl.load(bias_ids_ptr + row * stride_bias + entries, mask=in_row, other=-1)
            values = tl.load(bias_values_ptr + row * stride_bias + entries, mask=in_row, other=0.0)
            valid = in_row & (ids >= 0) & (ids < vocab_size)
            tl.atomic_add(out_row + ids, values, mask=valid)
        if HAS_PENALTIES:
            tl.debug_barrier()
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vocab_size
                x = tl.load(out_row + cols, mask=mask, other=0.0)
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
    block, num_warps = _launch_config(vocab_size)
    _bias_penalties_kernel[(num_rows,)](
        logits,
        out,
        counts if counts is not None else out,
        prompt_mask if prompt_mask is not None else out,
        batch.state_rows if batch.state_rows is not None else out,
        bias_ids if bias_ids is not None else out,
        bias_values if bias_values is not None else out,
        batch.presence_penalty,
        batch.frequency_penalty,
        batch.repetition_penalty,
        vocab_size,
        num_bias,
        logits.stride(0),
        out.stride(0),
        counts.stride(0) if counts is not None else 0,
        prompt_mask.stride(0) if prompt_mask is not None else 0,
        bias_ids.stride(0) if bias_ids is not None else 0,
        HAS_COUNTS=counts is not None,
        HAS_PROMPT_MASK=prompt_mask is not None,
        HAS_STATE_ROWS=batch.state_rows is not None,
        HAS_PENALTIES=counts is not None or prompt_mask is not None,
        HAS_BIAS=num_bias > 0,
        BLOCK=block,
        BLOCK_BIAS=min(triton.next_power_of_2(max(num_bias, 1)), 1024),
        num_warps=num_warps,
        # No fused multiply-add: `x - penalty * count` rounds as the reference's does.
        enable_fp_fusion=False,
    )
    return out


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
