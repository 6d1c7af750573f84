"""The sampler: steps 1-6 put together, and the draw itself (greedy argmax or the
exponential race over the kept tokens; the torch path's in race.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.sampling.common import (
    SAMPLING_EPS,
    SamplerOutput,
    SamplingBatch,
    _launch_config,
    _rows,
    _rows_where,
)
from aioserve.kernels.sampling.logprobs import (
    _empty_logprobs,
    compute_logprobs_reference,
    compute_logprobs_triton,
)
from aioserve.kernels.sampling.masks import (
    _keep_mask_reference,
    _launch_masks,
    _top_p_keep_reference,
)
from aioserve.kernels.sampling.penalties import (
    _needs_processing,
    apply_bias_and_penalties_reference,
    apply_bias_and_penalties_triton,
)
from aioserve.kernels.sampling.race import (
    RACE_CUTOFF,
    RaceWinners,
    first_argmax,
    race_among,
    race_reference,
)
from aioserve.kernels.sampling.token_bitmask import (
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
)
from aioserve.kernels.sampling.uniform import (
    _row_key,
    _row_key_reference,
    _uniform,
)
from aioserve.kernels.triton_compat import tl, triton

# When every random row has a top-k of at most this, the reference works on the top-k
# tokens alone.
_SMALL_TOP_K = 1024
# How many tokens past the largest k it takes, for ties at the k-th value.
_TOP_K_TIE_ROOM = 64


@triton.jit
def _sample_kernel(
    processed_ptr,
    masked_ptr,
    row_max_ptr,
    temperature_ptr,
    seeds_ptr,
    steps_ptr,
    out_ptr,
    vocab_size,
    stride_processed,
    stride_masked,
    greedy_below,
    BLOCK: tl.constexpr,
):
    # Greedy rows: first argmax of the processed logits. Random rows: the exponential
    # race over the masked, scaled logits. Ties go to the lower token id in both.
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    if temperature < greedy_below:
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            x = tl.load(processed_ptr + row * stride_processed + cols, mask=mask, other=0.0)
            x = tl.where(mask, x.to(tl.float32), float("-inf"))
            block_best = tl.max(x, axis=0)
            block_id = tl.min(tl.where(mask & (x == block_best), cols, vocab_size), axis=0)
            better = block_best > best
            best = tl.where(better, block_best, best)
            best_id = tl.where(better, block_id, best_id)
    else:
        row_max = tl.load(row_max_ptr + row)
        key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            s = tl.load(masked_ptr + row * stride_masked + cols, mask=mask, other=float("-inf"))
            score = tl.math.div_rn(tl.exp(s - row_max), -tl.log(_uniform(key, cols)))
            score = tl.where(mask, score, -1.0)
            block_best = tl.max(score, axis=0)
            block_id = tl.min(tl.where(mask & (score == block_best), cols, vocab_size), axis=0)
            better = block_best > best
            best = tl.where(better, block_best, best)
            best_id = tl.where(better, block_id, best_id)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def sample_triton(logits: Tensor, batch: SamplingBatch, raw: Tensor | None = None) -> SamplerOutput:
    """The Triton path of `sample`."""
    logits = _rows(logits)
    num_rows, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return SamplerOutput(token_ids, _empty_logprobs(batch, device))

    processed = (
        apply_bias_and_penalties_triton(logits, batch) if _needs_processing(batch) else logits
    )
    if batch.token_bitmask is not None:
        apply_token_bitmask_triton(processed, batch.token_bitmask, batch.bitmask_rows)
    # What the sample kernel reads for random rows (none if all greedy); after the masks,
    # every row's processed logits (the processed logprobs modes report them).
    masked = processed
    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    if not batch.all_greedy:
        if processed is logits:  # never write into the caller's logits
            masked = torch.empty_like(logits, dtype=torch.float32)
            if batch.reports_processed and batch.num_logprobs >= 0:
                masked.copy_(logits)  # the greedy rows, which the mask kernels skip
        # Otherwise in place: the kernel leaves greedy rows as they are.
        _launch_masks(
            processed,
            masked,
            row_max,
            batch.temperature,
            batch.top_k,
            batch.top_p,
            batch.min_p,
            uses_top_k=batch.uses_top_k,
            uses_top_p=batch.uses_top_p,
        )
    block, num_warps = _launch_config(vocab_size)
    _sample_kernel[(num_rows,)](
        processed,
        masked,
        row_max,
        batch.temperature,
        batch.seeds,
        batch.steps,
        token_ids,
        vocab_size,
        processed.stride(0),
        masked.stride(0),
        SAMPLING_EPS,
        BLOCK=block,
        num_warps=num_warps,
    )
    raw = logits if raw is None else raw
    return _with_logprobs(token_ids, raw, masked, batch, compute_logprobs_triton)


def _sample_within_top_k_reference(
    s: Tensor, row_max: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor
) -> Tensor | None:
    """The draw when every row has a top-k of at most _SMALL_TOP_K; None otherwise.

    Min-p, top-p and the race then only concern the top-k tokens, so they run on those
    alone instead of the whole vocabulary. Top-k keeps every token tied with the k-th
    value, so torch.topk picks _TOP_K_TIE_ROOM more than the largest k: the logits of a
    bfloat16 model tie often. Also None when a row's ties reach past those.
    """
    vocab_size = s.shape[1]
    if not bool(((top_k > 0) & (top_k <= _SMALL_TOP_K) & (top_k < vocab_size)).all()):
        return None
    k = top_k.long()[:, None]
    values, ids = torch.topk(s, min(vocab_size, int(k.max()) + _TOP_K_TIE_ROOM), dim=-1)
    kth = values.gather(1, k - 1)
    if values.shape[1] < vocab_size and not bool((values[:, -1:] < kth).all()):
        return None
    e = torch.exp(values - row_max)
    keep = (values >= kth) & (e >= min_p[:, None])
    uses_top_p = top_p < 1.0
    if bool(uses_top_p.any()):
        rows = _rows_where(uses_top_p)
        keep[rows] &= _top_p_keep_reference(e[rows], keep[rows], top_p[rows])
    rows, slots = (keep & (values > row_max - RACE_CUTOFF)).nonzero(as_tuple=True)
    return race_among(rows, ids[rows, slots], values[rows, slots], row_max, keys)


def sample_reference(
    logits: Tensor, batch: SamplingBatch, race: RaceWinners | None = None, raw: Tensor | None = None
) -> SamplerOutput:
    """The torch path of `sample`."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        token_ids = torch.empty(0, dtype=torch.int64, device=logits.device)
        return SamplerOutput(token_ids, _empty_logprobs(batch, logits.device))
    x = apply_bias_and_penalties_reference(logits, batch)
    if batch.token_bitmask is not None:
        if x is logits:  # never write into the caller's logits
            x = x.clone()
        apply_token_bitmask_reference(x, batch.token_bitmask, batch.bitmask_rows)
    if batch.all_random:
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    else:
        token_ids = first_argmax(x)
    processed = x  # every row's processed logits, for the processed logprobs modes
    if not batch.all_greedy:
        rows = _rows_where(batch.temperature >= SAMPLING_EPS)
        s = x[rows] / batch.temperature[rows, None]
        row_max = s.amax(-1, keepdim=True)
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        keys = _row_key_reference(batch.seeds[rows], batch.steps[rows])
        drawn = _sample_within_top_k_reference(s, row_max, top_k, top_p, min_p, keys)
        keep = None
        if drawn is None or (batch.reports_processed and batch.num_logprobs >= 0):
            keep = _keep_mask_reference(s, row_max, top_k, top_p, min_p)
        if drawn is None:
            drawn = race_reference(s, row_max, keep, keys, race)
        token_ids[rows] = drawn
        if batch.reports_processed and batch.num_logprobs >= 0:
            processed = x.clone()  # x may be the caller's logits
            processed[rows] = s if keep is None else s.masked_fill(~keep, float("-inf"))
    raw = logits if raw is None else raw
    return _with_logprobs(token_ids, raw, processed, batch, compute_logprobs_reference)


def _with_logprobs(
    token_ids: Tensor, logits: Tensor, processed: Tensor, batch: SamplingBatch, compute
) -> SamplerOutput:
    """The output, with the logprobs the batch's mode names when it asked for logprobs:
    `compute` (a path of compute_logprobs) over the raw `logits` or the `processed` ones,
    normalized or not."""
    if batch.num_logprobs < 0:
        return SamplerOutput(token_ids, None)
    scores = processed if batch.reports_processed else logits
    normalized = batch.checked_logprobs_mode().endswith("_logprobs")
    logprobs = compute(scores, token_ids, batch.num_logprobs, normalized=normalized)
    kept = processed.float() if batch.reports_processed else None
    return SamplerOutput(token_ids, logprobs, kept)


def sample(
    logits: Tensor, batch: SamplingBatch, race: RaceWinners | None = None, raw: Tensor | None = None
) -> SamplerOutput:
    """Pick one token per row of `logits` [B, V] (any float dtype) as `batch` says.

    Returns the token ids and, when `batch.num_logprobs >= 0`, their logprobs, rank and
    the top `num_logprobs` alternatives, as `batch.logprobs_mode` says (raw logprobs by
    default; the processed modes report the values the draw saw, and never change which
    token is drawn). `logits` is left untouched. `race`, a compiled
    race.race_winners (runner/sampler_graphs.py), draws the torch path's random rows
    whose top-k does not narrow them first; the Triton path has its own kernel. `raw`: the
    logits the raw logprobs modes report when they are not `logits` (the model's, when
    custom logits processors changed them into `logits`).
    """
    if dispatch.use_triton():
        return sample_triton(logits, batch, raw)
    return sample_reference(logits, batch, race, raw)
