"""Sampling step 6: the sampled tokens' logprobs (or logits: `compute_logprobs`), rank, top n."""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.sampling.common import LogprobsTensors, SamplingBatch, _launch_config, _rows
from aioserve.kernels.triton_compat import tl, triton


@triton.jit
def _logprobs_kernel(
    logits_ptr,
    token_ids_ptr,
    sampled_logprob_ptr,
    sampled_rank_ptr,
    top_ids_ptr,
    top_logprobs_ptr,
    vocab_size,
    num_top,
    stride_logits,
    stride_top,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    token = tl.load(token_ids_ptr + row)
    token_logit = tl.load(logits_row + token).to(tl.float32)

    # log-sum-exp as torch.logsumexp computes it: the max, then the sum of exp(x - max).
    block_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        block_max = tl.maximum(block_max, x)
    row_max = tl.max(block_max, axis=0)
    sum_exp = tl.zeros([BLOCK], dtype=tl.float32)
    higher = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        sum_exp += tl.exp(x - row_max)
        higher += (x > token_logit).to(tl.int32)
    log_sum_exp = row_max + tl.log(tl.sum(sum_exp, axis=0))
    tl.store(sampled_logprob_ptr + row, token_logit - log_sum_exp)
    tl.store(sampled_rank_ptr + row, 1 + tl.sum(higher, axis=0).to(tl.int64))

    # Top-n: n passes, each taking the largest (value, lowest id) that comes after the
    # previous pick in the order "descending value, then ascending id".
    previous = tl.full([], float("inf"), tl.float32)
    previous_id = tl.full([], -1, tl.int32)
    for rank in range(0, num_top):
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.full([], 0x7FFFFFFF, tl.int32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            after = (x < previous) | ((x == previous) & (cols > previous_id))
            eligible = mask & after
            block_best = tl.max(tl.where(eligible, x, float("-inf")), axis=0)
            block_id = tl.min(tl.where(eligible & (x == block_best), cols, 0x7FFFFFFF), axis=0)
            better = (block_best > best) | ((block_best == best) & (block_id < best_id))
            best = tl.where(better, block_best, best)
            best_id = tl.where(better, block_id, best_id)
        tl.store(top_ids_ptr + row * stride_top + rank, best_id.to(tl.int64))
        tl.store(top_logprobs_ptr + row * stride_top + rank, best - log_sum_exp)
        previous = best
        previous_id = best_id


def compute_logprobs_triton(
    logits: Tensor, token_ids: Tensor, num_logprobs: int, *, normalized: bool = True
) -> LogprobsTensors:
    """The Triton path of `compute_logprobs`."""
    logits = _rows(logits)
    num_rows, vocab_size = logits.shape
    if num_logprobs > vocab_size:
        raise ValueError(f"num_logprobs={num_logprobs} exceeds the vocabulary ({vocab_size})")
    device = logits.device
    result = LogprobsTensors(
        sampled_logprob=torch.empty(num_rows, dtype=torch.float32, device=device),
        sampled_rank=torch.empty(num_rows, dtype=torch.int64, device=device),
        top_token_ids=torch.empty((num_rows, num_logprobs), dtype=torch.int64, device=device),
        top_logprobs=torch.empty((num_rows, num_logprobs), dtype=torch.float32, device=device),
    )
    if num_rows == 0:
        return result
    block, num_warps = _launch_config(vocab_size)
    _logprobs_kernel[(num_rows,)](
        logits,
        token_ids.contiguous(),
        result.sampled_logprob,
        result.sampled_rank,
        result.top_token_ids,
        result.top_logprobs,
        vocab_size,
        num_logprobs,
        logits.stride(0),
        max(num_logprobs, 1),
        BLOCK=block,
        num_warps=num_warps,
    )
    if not normalized:  # the values themselves, at the ids the kernel ranked over them
        values = logits.float()
        result.sampled_logprob = values.gather(1, token_ids[:, None]).squeeze(1)
        result.top_logprobs = values.gather(1, result.top_token_ids)
    return result


def _top_n_reference(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n largest values of each row and their ids, descending, ties by lower id."""
    num_rows = x.shape[0]
    if n == 0:
        return x.new_empty((num_rows, 0), dtype=torch.int64), x.new_empty((num_rows, 0))
    # Every token >= the n-th largest value, grouped by row, each row by descending value
    # with ties in id order (nonzero lists ids in order; both sorts are stable).
    boundary = torch.topk(x, n, dim=-1).values[:, -1:]
    rows, cols = (x >= boundary).nonzero(as_tuple=True)
    values = x[rows, cols]
    order = torch.sort(values, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    counts = torch.bincount(rows, minlength=num_rows)
    firsts = counts.cumsum(0) - counts
    picks = order[firsts[:, None] + torch.arange(n, device=x.device)]
    return cols[picks], values[picks]


def compute_logprobs_reference(
    logits: Tensor, token_ids: Tensor, num_logprobs: int, *, normalized: bool = True
) -> LogprobsTensors:
    """The torch path of `compute_logprobs`."""
    x = logits.float()
    if num_logprobs > x.shape[1]:
        raise ValueError(f"num_logprobs={num_logprobs} exceeds the vocabulary ({x.shape[1]})")
    if not normalized:
        log_sum_exp = x.new_zeros(x.shape[0])  # x - 0 is x, -inf included
    elif dispatch.batch_invariant():
        # torch splits the rows of a small batch across threads, which changes the order of
        # a row's sum with the batch size; one row at a time, every row is summed alike.
        log_sum_exp = torch.cat([torch.logsumexp(x[i : i + 1], dim=-1) for i in range(x.shape[0])])
    else:
        log_sum_exp = torch.logsumexp(x, dim=-1)
    token_logit = x.gather(1, token_ids[:, None])
    top_ids, top_values = _top_n_reference(x, num_logprobs)
    return LogprobsTensors(
        sampled_logprob=token_logit.squeeze(1) - log_sum_exp,
        sampled_rank=1 + (x > token_logit).sum(-1),
        top_token_ids=top_ids,
        top_logprobs=top_values - log_sum_exp[:, None],
    )


def _empty_logprobs(batch: SamplingBatch, device: torch.device) -> LogprobsTensors | None:
    if batch.num_logprobs < 0:
        return None
    n = batch.num_logprobs
    return LogprobsTensors(
        sampled_logprob=torch.empty(0, dtype=torch.float32, device=device),
        sampled_rank=torch.empty(0, dtype=torch.int64, device=device),
        top_token_ids=torch.empty((0, n), dtype=torch.int64, device=device),
        top_logprobs=torch.empty((0, n), dtype=torch.float32, device=device),
    )


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, num_logprobs: int, *, normalized: bool = True
) -> LogprobsTensors:
    """Logprobs (log_softmax of the float32 logits) of `token_ids`, their rank and the top
    n; with `normalized=False` the float32 logits themselves (the logits modes).

    The logits are those the logprobs mode names, raw or processed (sampler.py). Either way
    the rank and the top n are found over them before any log-softmax, which orders them
    alike; unnormalized, the values are then read back exactly (the reference skips the
    subtraction; the Triton path gathers them at the ids its kernel found)."""
    if dispatch.use_triton():
        return compute_logprobs_triton(logits, token_ids, num_logprobs, normalized=normalized)
    return compute_logprobs_reference(logits, token_ids, num_logprobs, normalized=normalized)
