"""Sampling step 5 without the draw: temperature, then the min-p, top-k and top-p masks.

The Triton kernel finds the top-k and top-p thresholds without sorting, by radix select
over the order-preserving integer image of float32 values: 8 passes over the row each
(against the 32 and 30 of a bisection), every pass counting (top-k) or weighing
(top-p) the remaining candidates by their next 4-bit digit, from the top. Probability mass
is summed in 2**-40 fixed point, so the masks do not depend on summation order, and the
thresholds are exactly the reference's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.sampling.common import SAMPLING_EPS, _launch_config, _rows_where
from aioserve.kernels.triton_compat import tl, triton

# Probability mass is summed as int64 multiples of 2**-40 (see the module docstring).
_MASS_SCALE = float(2**40)

# The kernel's radix select: 4-bit digits, 16 bins a pass, 8 passes for 32 bits.
_RADIX_BINS = 16


# The reference's top-p sorts only the tokens with e >= this floor, lowering it (2**-20,
# 2**-30, ..., then 0) until they hold the top_p mass; most rows need only the first.
_TOP_P_FIRST_FLOOR = 2.0**-10


@triton.jit
def _order_key(x):
    # float32 -> int32 with the same order (and -0.0, +0.0 both mapped to 0).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


@triton.jit
def _next_digit(hist, held_above, target):
    # hist [16]: the candidates' count or mass by their next digit; held_above: what the
    # tokens above the candidates hold. Returns the largest digit d such that the
    # candidates with digit >= d and the tokens above them hold at least `target`
    # (compared in float64), and what the tokens above digit d then hold.
    bins = tl.arange(0, 16)
    suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0), axis=1)
    reaches = (held_above + suffix).to(tl.float64) >= target
    digit = tl.max(tl.where(reaches, bins, -1), axis=0)
    return digit, held_above + tl.sum(tl.where(bins > digit, hist, 0), axis=0)


@triton.jit
def _mask_kernel(
    src_ptr,
    out_ptr,
    row_max_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab_size,
    stride_src,
    stride_out,
    greedy_below,
    BLOCK: tl.constexpr,
    HIST_BLOCK: tl.constexpr,
):
    # Random rows only: out = src / temperature, with -inf where min-p, top-k or top-p
    # drops the token; row_max = the row's largest scaled logit. Greedy rows are skipped.
    row = tl.program_id(0).to(tl.int64)
    src_row = src_ptr + row * stride_src
    out_row = out_ptr + row * stride_out
    temperature = tl.load(temperature_ptr + row)
    if temperature >= greedy_below:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)

        block_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab_size
            x = tl.load(src_row + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.math.div_rn(x, temperature)
            tl.store(out_row + cols, s, mask=mask)
            block_max = tl.maximum(block_max, tl.where(mask, s, float("-inf")))
        row_max = tl.max(block_max, axis=0)
        tl.store(row_max_ptr + row, row_max)
        tl.debug_barrier()  # the passes below read back what this one stored

        # Top-k: the order key of the k-th largest value, found digit by digit from the
        # top. Keys are offset by 0x7F800000 to [0, 0xFF000000]; the candidates of a pass
        # are the tokens whose higher digits are the `prefix` found so far.
        top_k_key = tl.full([], -0x7F800000, tl.int64)
        if (top_k > 0) & (top_k < vocab_size):
            prefix = tl.full([], 0, tl.int64)
            larger = tl.full([], 0, tl.int32)
            for radix_pass in range(8):
                shift = 28 - 4 * radix_pass
                hist = tl.zeros([16], dtype=tl.int32)
                for start in range(0, vocab_size, HIST_BLOCK):
                    cols = start + tl.arange(0, HIST_BLOCK)
                    mask = cols < vocab_size
                    s = tl.load(out_row + cols, mask=mask, other=0.0)
                    key = _order_key(s).to(tl.int64) + 0x7F800000
                    candidate = mask & ((key >> (shift + 4)) == prefix)
                    digit = (key >> shift) & 15
                    in_bin = (digit[:, None] == tl.arange(0, 16)[None, :]) & candidate[:, None]
                    hist += tl.sum(in_bin.to(tl.int32), axis=0)
                digit, larger = _next_digit(hist, larger, top_k.to(tl.float64))
                prefix = prefix * 16 + digit
            top_k_key = prefix - 0x7F800000

        # Top-p over the tokens min-p and top-k keep: the largest bit pattern b of a
        # probability such that the tokens whose e has bits >= b hold at least
        # top_p * total of the mass; they are the ones kept. Found digit by digit from the
        # top, weighing the candidates by mass. Masses are int64 multiples of 2**-40
        # (1099511627776.0 = _MASS_SCALE).
        top_p_bits = tl.full([], 0, tl.int64)
        if top_p < 1.0:
            total = tl.zeros([BLOCK], dtype=tl.int64)
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vocab_size
                s = tl.load(out_row + cols, mask=mask, other=float("-inf"))
                e = tl.exp(s - row_max)
                kept = mask & (_order_key(s) >= top_k_key) & (e >= min_p)
                total += tl.where(kept, (e * 1099511627776.0).to(tl.int64), 0)
            limit = tl.sum(total, axis=0).to(tl.float64) * top_p.to(tl.float64)
            prefix = tl.full([], 0, tl.int64)
            heavier = tl.full([], 0, tl.int64)
            for radix_pass in range(8):
                shift = 28 - 4 * radix_pass
                hist = tl.zeros([16], dtype=tl.int64)
                for start in range(0, vocab_size, HIST_BLOCK):
                    cols = start + tl.arange(0, HIST_BLOCK)
                    mask = cols < vocab_size
                    s = tl.load(out_row + cols, mask=mask, other=float("-inf"))
                    e = tl.exp(s - row_max)
                    kept = mask & (_order_key(s) >= top_k_key) & (e >= min_p)
                    bits = e.to(tl.int32, bitcast=True).to(tl.int64)
                    candidate = kept & ((bits >> (shift + 4)) == prefix)
                    digit = (bits >> shift) & 15
                    in_bin = (digit[:, None] == tl.arange(0, 16)[None, :]) & candidate[:, None]
                    mass = (e * 1099511627776.0).to(tl.int64)
                    hist += tl.sum(tl.where(in_bin, mass[:, None], 0), axis=0)
                digit, heavier = _next_digit(hist, heavier, limit)
                prefix = prefix * 16 + digit
            top_p_bits = prefix

        if (top_k_key > -0x7F800000) | (min_p > 0.0) | (top_p_bits > 0):
            tl.debug_barrier()
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vocab_size
                s = tl.load(out_row + cols, mask=mask, other=float("-inf"))
                e = tl.exp(s - row_max)
                kept = (_order_key(s) >= top_k_key) & (e >= min_p)
                kept = kept & (e.to(tl.int32, bitcast=True) >= top_p_bits)
                tl.store(out_row + cols, tl.where(kept, s, float("-inf")), mask=mask)


def _launch_masks(
    src: Tensor,
    out: Tensor,
    row_max: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
) -> None:
    """Run the mask kernel from `src` into `out` (may be the same tensor) and `row_max`."""
    num_rows, vocab_size = src.shape
    if num_rows == 0:
        return
    block, num_warps = _launch_config(vocab_size)
    _mask_kernel[(num_rows,)](
        src,
        out,
        row_max,
        temperature,
        top_k,
        top_p,
        min_p,
        vocab_size,
        src.stride(0),
        out.stride(0),
        SAMPLING_EPS,
        BLOCK=block,
        # A radix pass holds a [HIST_BLOCK, 16] one-hot: as many elements as BLOCK.
        HIST_BLOCK=max(block // _RADIX_BINS, 16),
        num_warps=num_warps,
    )


def apply_sampling_masks_triton(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """The Triton path of `apply_sampling_masks`."""
    out = logits.to(torch.float32, copy=True)
    row_max = torch.empty(out.shape[0], dtype=torch.float32, device=out.device)
    _launch_masks(out, out, row_max, temperature, top_k, top_p, min_p)
    return out


def _top_p_keep_reference(e: Tensor, keep: Tensor, top_p: Tensor) -> Tensor:
    """Which tokens top-p keeps, given e = exp(s - max) and the tokens still in play.

    Only the likely tokens are sorted: those with e above a floor low enough for them to
    hold the top_p mass (the floor drops until they do). Sorting whole rows of a large
    vocabulary is far slower on the CPU.
    """
    num_rows = e.shape[0]
    e = torch.where(keep, e, 0.0)
    mass = (e * _MASS_SCALE).to(torch.int64)
    limit = mass.sum(-1).double() * top_p.double()
    floor = _TOP_P_FIRST_FLOOR
    while True:
        rows, cols = (e >= floor).nonzero(as_tuple=True)
        held = torch.zeros_like(limit, dtype=torch.int64).index_add_(0, rows, mass[rows, cols])
        if floor == 0.0 or bool((held.double() >= limit).all()):
            break
        floor = floor * _TOP_P_FIRST_FLOOR if floor > 2.0**-60 else 0.0
    # Lay the candidates out one row each, padded with zeros, and sort each row.
    counts = torch.bincount(rows, minlength=num_rows)
    position = torch.arange(rows.numel(), device=e.device) - (counts.cumsum(0) - counts)[rows]
    candidates = e.new_zeros((num_rows, int(counts.max())))
    candidates.index_put_((rows, position), e[rows, cols])
    sorted_values = torch.sort(candidates, dim=-1, descending=True).values
    sorted_mass = (sorted_values * _MASS_SCALE).to(torch.int64)
    # mass_above[j]: the mass sorted before position j. It only grows along the row (the
    # padding sees all of the candidates' mass, which reaches the limit), so the positions
    # below the limit are a prefix; the value at its end is the threshold (tokens equal
    # to it are kept with it).
    mass_above = (sorted_mass.cumsum(-1) - sorted_mass).double()
    last = (mass_above < limit[:, None]).sum(-1, keepdim=True) - 1
    return e >= sorted_values.gather(1, last)


def _keep_mask_reference(
    s: Tensor, row_max: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor | None:
    """What min-p, top-k and top-p keep of the scaled logits `s`; None when nothing is dropped."""
    vocab_size = s.shape[1]
    uses_min_p = min_p > 0.0
    uses_top_k = (top_k > 0) & (top_k < vocab_size)
    uses_top_p = top_p < 1.0
    if not bool((uses_min_p | uses_top_k | uses_top_p).any()):
        return None
    keep = torch.ones_like(s, dtype=torch.bool)
    e = torch.exp(s - row_max) if bool((uses_min_p | uses_top_p).any()) else None
    if bool(uses_min_p.any()):
        keep &= e >= min_p[:, None]
    if bool(uses_top_k.any()):
        rows = _rows_where(uses_top_k)
        k = top_k[rows].long()
        kth = torch.topk(s[rows], int(k.max()), dim=-1).values.gather(1, k[:, None] - 1)
        keep[rows] &= s[rows] >= kth
    if bool(uses_top_p.any()):
        rows = _rows_where(uses_top_p)
        keep[rows] &= _top_p_keep_reference(e[rows], keep[rows], top_p[rows])
    return keep


def apply_sampling_masks_reference(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """The torch path of `apply_sampling_masks`."""
    out = logits.to(torch.float32, copy=True)
    rows = _rows_where(temperature >= SAMPLING_EPS)
    s = out[rows] / temperature[rows, None]
    keep = _keep_mask_reference(s, s.amax(-1, keepdim=True), top_k[rows], top_p[rows], min_p[rows])
    out[rows] = s if keep is None else s.masked_fill(~keep, float("-inf"))
    return out


def apply_sampling_masks(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """Step 5 without the draw: float32 logits / temperature, -inf where a mask drops them.

    Rows with a temperature below SAMPLING_EPS (greedy) are returned unscaled and unmasked.
    """
    if dispatch.use_triton():
        return apply_sampling_masks_triton(logits, temperature, top_k, top_p, min_p)
    return apply_sampling_masks_reference(logits, temperature, top_k, top_p, min_p)
