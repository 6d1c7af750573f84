"""Sampling step 5 without the draw: temperature, then the min-p, top-k and top-p masks.

The Triton kernels find the top-k and top-p thresholds without sorting, by radix select
over the order-preserving integer image of float32 values: 8 passes over the row each
(against the 32 and 30 of a bisection), every pass counting (top-k) or weighing
(top-p) the remaining candidates by their next 4-bit digit, from the top. Probability mass
is summed in 2**-40 fixed point, so the masks do not depend on summation order, and the
thresholds are exactly the reference's.

Each row is split over several programs, so that one row does not walk a 128k vocabulary
on one GPU core (6.5 ms on an H100 when it did): every pass is a launch over
(row, split) programs, each writing its split's histogram; the next pass adds the
splits' histograms up (integers, so exactly) to know the digits found so far.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.sampling.common import SAMPLING_EPS, _launch_config, _rows_where
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Probability mass is summed as int64 multiples of 2**-40 (see the module docstring).
_MASS_SCALE = float(2**40)

# The kernels' radix select: 4-bit digits, 16 bins a pass, 8 passes for 32 bits.
_RADIX_BINS = 16

# Programs the mask kernels aim for across a batch: a row is split over up to this many so
# that a small batch still fills a GPU. Not more: every program adds up the histograms of
# all the row's splits for each pass before it (splits squared reads a launch). The CPU's
# figure only matters under Triton's interpreter (the CPU runs the reference), where a
# split of a few programs is what the tests exercise.
_ROW_PROGRAMS = {"cuda": 128, "rocm": 128, "cpu": 3}


# The reference's top-p bins a row's values by their float32 bits shifted right by this:
# the exponent and the first four mantissa bits, 16 bins an octave; e <= 1.0 (0x3F800000)
# fits in _TOP_P_BINS.
_TOP_P_BIN_SHIFT = 19
_TOP_P_BINS = (0x3F800000 >> _TOP_P_BIN_SHIFT) + 1
# Where a row's top-p threshold is first looked for: among its largest values.
_TOP_P_FIRST_TOKENS = 256


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
def _radix_prefix(hist_ptr, row, num_passes, target):
    # The digits found by the first `num_passes` radix passes of `row`, as one number, and
    # what the tokens above them hold. hist [rows, 8, splits, 16] int64: each pass's
    # histogram by split, added up here 32 splits at a time (integers: any order is exact;
    # all the splits at once would spill registers).
    splits = tl.num_programs(1)
    bins = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.int64)
    held = tl.full([], 0, tl.int64)
    for radix_pass in range(num_passes):
        first = (row * 8 + radix_pass) * splits
        hist = tl.zeros([16], dtype=tl.int64)
        for chunk in range(0, splits, 32):
            split_ids = chunk + tl.arange(0, 32)
            parts = tl.load(
                hist_ptr + (first + split_ids[:, None]) * 16 + bins[None, :],
                mask=(split_ids < splits)[:, None],
                other=0,
            )
            hist += tl.sum(parts, axis=0)
        digit, held = _next_digit(hist, held, target)
        prefix = prefix * 16 + digit
    return prefix, held


@triton.jit
def _split_bounds(span, vocab_size):
    # The tokens [begin, end) of this program's split of its row.
    begin = tl.program_id(1) * span
    return begin, tl.minimum(begin + span, vocab_size)


@triton.jit
def _kept(s, mask, row_max, top_k_key, min_p):
    # e = exp(s - max), and which tokens min-p and top-k keep (of those under `mask`).
    e = tl.exp(s - row_max)
    return e, mask & (_order_key(s) >= top_k_key) & (e >= min_p)


@triton.jit
def _row_max(split_max_ptr, row, BLOCK_S: tl.constexpr):
    splits = tl.num_programs(1)
    split_ids = tl.arange(0, BLOCK_S)
    maxes = tl.load(
        split_max_ptr + row * splits + split_ids, mask=split_ids < splits, other=float("-inf")
    )
    return tl.max(maxes, axis=0)


@triton.jit
def _top_k_key(hist_k_ptr, row, top_k, vocab_size):
    # The order key of the k-th largest scaled logit; the lowest key when top-k is off.
    key = tl.full([], -0x7F800000, tl.int64)
    if (top_k > 0) & (top_k < vocab_size):
        prefix, _ = _radix_prefix(hist_k_ptr, row, 8, top_k.to(tl.float64))
        key = prefix - 0x7F800000
    return key


@triton.jit
def _top_p_limit(mass_ptr, row, top_p, BLOCK_S: tl.constexpr):
    # top_p times the mass of the tokens min-p and top-k keep, summed over the splits.
    splits = tl.num_programs(1)
    split_ids = tl.arange(0, BLOCK_S)
    parts = tl.load(mass_ptr + row * splits + split_ids, mask=split_ids < splits, other=0)
    return tl.sum(parts, axis=0).to(tl.float64) * top_p.to(tl.float64)


@triton.jit
def _scale_kernel(
    src_ptr,
    out_ptr,
    split_max_ptr,
    temperature_ptr,
    vocab_size,
    stride_src,
    stride_out,
    greedy_below,
    span,
    BLOCK: tl.constexpr,
):
    # One program per (row, split of `span` tokens), random rows only: out = src /
    # temperature, and the split's largest value.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    if temperature >= greedy_below:
        begin, end = _split_bounds(span, vocab_size)
        block_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(begin, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < end
            x = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.math.div_rn(x, temperature)
            tl.store(out_ptr + row * stride_out + cols, s, mask=mask)
            block_max = tl.maximum(block_max, tl.where(mask, s, float("-inf")))
        tl.store(split_max_ptr + row * tl.num_programs(1) + split, tl.max(block_max, axis=0))


@triton.jit
def _top_k_pass_kernel(
    out_ptr,
    hist_k_ptr,
    temperature_ptr,
    top_k_ptr,
    vocab_size,
    stride_out,
    greedy_below,
    span,
    radix_pass,
    HIST_BLOCK: tl.constexpr,
):
    # Top-k, radix pass `radix_pass`: the order key of the k-th largest value is found
    # digit by digit from the top. Keys are offset by 0x7F800000 to [0, 0xFF000000]; the
    # candidates of a pass are the tokens whose higher digits are the prefix found so far.
    # Each split counts its candidates by their next digit.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    top_k = tl.load(top_k_ptr + row)
    if (tl.load(temperature_ptr + row) >= greedy_below) & (top_k > 0) & (top_k < vocab_size):
        prefix, _ = _radix_prefix(hist_k_ptr, row, radix_pass, top_k.to(tl.float64))
        shift = 28 - 4 * radix_pass
        begin, end = _split_bounds(span, vocab_size)
        hist = tl.zeros([16], dtype=tl.int64)
        for start in range(begin, end, HIST_BLOCK):
            cols = start + tl.arange(0, HIST_BLOCK)
            mask = cols < end
            s = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=0.0)
            key = _order_key(s).to(tl.int64) + 0x7F800000
            candidate = mask & ((key >> (shift + 4)) == prefix)
            digit = (key >> shift) & 15
            in_bin = (digit[:, None] == tl.arange(0, 16)[None, :]) & candidate[:, None]
            hist += tl.sum(in_bin.to(tl.int64), axis=0)
        slot = ((row * 8 + radix_pass) * tl.num_programs(1) + split) * 16
        tl.store(hist_k_ptr + slot + tl.arange(0, 16), hist)


@triton.jit
def _top_p_mass_kernel(
    out_ptr,
    split_max_ptr,
    hist_k_ptr,
    mass_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab_size,
    stride_out,
    greedy_below,
    span,
    BLOCK_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Top-p, first: each split's mass of the tokens min-p and top-k keep, as int64
    # multiples of 2**-40 (1099511627776.0 = _MASS_SCALE).
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if (tl.load(temperature_ptr + row) >= greedy_below) & (tl.load(top_p_ptr + row) < 1.0):
        row_max = _row_max(split_max_ptr, row, BLOCK_S)
        top_k_key = _top_k_key(hist_k_ptr, row, tl.load(top_k_ptr + row), vocab_size)
        min_p = tl.load(min_p_ptr + row)
        begin, end = _split_bounds(span, vocab_size)
        total = tl.full([], 0, tl.int64)  # a scalar: a [BLOCK] int64 sum spills registers
        for start in range(begin, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < end
            s = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=float("-inf"))
            e, kept = _kept(s, mask, row_max, top_k_key, min_p)
            total += tl.sum(tl.where(kept, (e * 1099511627776.0).to(tl.int64), 0), axis=0)
        tl.store(mass_ptr + row * tl.num_programs(1) + split, total)


@triton.jit
def _top_p_pass_kernel(
    out_ptr,
    split_max_ptr,
    hist_k_ptr,
    mass_ptr,
    hist_p_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab_size,
    stride_out,
    greedy_below,
    span,
    radix_pass,
    BLOCK_S: tl.constexpr,
    HIST_BLOCK: tl.constexpr,
):
    # Top-p, radix pass `radix_pass`: the largest bit pattern b of a probability such that
    # the kept tokens whose e has bits >= b hold at least top_p of their mass, found digit
    # by digit from the top; each split weighs its candidates by mass.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    top_p = tl.load(top_p_ptr + row)
    if (tl.load(temperature_ptr + row) >= greedy_below) & (top_p < 1.0):
        row_max = _row_max(split_max_ptr, row, BLOCK_S)
        top_k_key = _top_k_key(hist_k_ptr, row, tl.load(top_k_ptr + row), vocab_size)
        min_p = tl.load(min_p_ptr + row)
        limit = _top_p_limit(mass_ptr, row, top_p, BLOCK_S)
        prefix, _ = _radix_prefix(hist_p_ptr, row, radix_pass, limit)
        shift = 28 - 4 * radix_pass
        begin, end = _split_bounds(span, vocab_size)
        hist = tl.zeros([16], dtype=tl.int64)
        for start in range(begin, end, HIST_BLOCK):
            cols = start + tl.arange(0, HIST_BLOCK)
            mask = cols < end
            s = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=float("-inf"))
            e, kept = _kept(s, mask, row_max, top_k_key, min_p)
            bits = e.to(tl.int32, bitcast=True).to(tl.int64)
            candidate = kept & ((bits >> (shift + 4)) == prefix)
            digit = (bits >> shift) & 15
            in_bin = (digit[:, None] == tl.arange(0, 16)[None, :]) & candidate[:, None]
            mass = (e * 1099511627776.0).to(tl.int64)
            hist += tl.sum(tl.where(in_bin, mass[:, None], 0), axis=0)
        slot = ((row * 8 + radix_pass) * tl.num_programs(1) + split) * 16
        tl.store(hist_p_ptr + slot + tl.arange(0, 16), hist)


@triton.jit
def _apply_masks_kernel(
    out_ptr,
    row_max_ptr,
    split_max_ptr,
    hist_k_ptr,
    mass_ptr,
    hist_p_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab_size,
    stride_out,
    greedy_below,
    span,
    BLOCK_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Last: -inf wherever min-p, top-k or top-p drops the token; the row's max for the draw.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(temperature_ptr + row) >= greedy_below:
        row_max = _row_max(split_max_ptr, row, BLOCK_S)
        if split == 0:
            tl.store(row_max_ptr + row, row_max)
        top_k_key = _top_k_key(hist_k_ptr, row, tl.load(top_k_ptr + row), vocab_size)
        min_p = tl.load(min_p_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        top_p_bits = tl.full([], 0, tl.int64)
        if top_p < 1.0:
            limit = _top_p_limit(mass_ptr, row, top_p, BLOCK_S)
            top_p_bits, _ = _radix_prefix(hist_p_ptr, row, 8, limit)
        if (top_k_key > -0x7F800000) | (min_p > 0.0) | (top_p_bits > 0):
            begin, end = _split_bounds(span, vocab_size)
            for start in range(begin, end, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < end
                s = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=float("-inf"))
                e, kept = _kept(s, mask, row_max, top_k_key, min_p)
                kept = kept & (e.to(tl.int32, bitcast=True) >= top_p_bits)
                tl.store(
                    out_ptr + row * stride_out + cols, tl.where(kept, s, float("-inf")), mask=mask
                )


def _num_splits(num_rows: int, vocab_size: int) -> int:
    """Programs a row is split over: enough to fill the device at small batch, at least 16
    tokens each. The masks come out the same for any split (their sums are integers), so
    this may depend on the batch."""
    wanted = triton.cdiv(launch_entry(_ROW_PROGRAMS), num_rows)
    return max(1, min(wanted, triton.cdiv(vocab_size, 16)))


def _launch_masks(
    src: Tensor,
    out: Tensor,
    row_max: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    splits: int | None = None,
    *,
    uses_top_k: bool = True,
    uses_top_p: bool = True,
) -> None:
    """Run the mask kernels from `src` into `out` (may be the same tensor) and `row_max`:
    one launch to scale, 8 radix passes for top-k, one to weigh top-p's mass, 8 passes for
    top-p and one to mask, each over (row, split) programs. The passes of top-k (top-p) are
    skipped when the caller knows no row uses it. `splits` overrides the split.

    Two launch configurations per vocabulary size, whatever the batch: rows split (the
    tile sized for the most splits) and rows whole, so a new batch size never compiles."""
    num_rows, vocab_size = src.shape
    if num_rows == 0:
        return
    row_programs = launch_entry(_ROW_PROGRAMS)
    splits = splits or _num_splits(num_rows, vocab_size)
    block, num_warps = _launch_config(
        vocab_size if splits == 1 else triton.cdiv(vocab_size, row_programs)
    )
    span = triton.cdiv(triton.cdiv(vocab_size, splits), block) * block  # whole blocks
    splits = triton.cdiv(vocab_size, span)
    device = src.device
    split_max = torch.empty(num_rows * splits, dtype=torch.float32, device=device)
    mass = torch.empty(num_rows * splits, dtype=torch.int64, device=device)
    hist_k = torch.empty(num_rows * 8 * splits * _RADIX_BINS, dtype=torch.int64, device=device)
    hist_p = torch.empty_like(hist_k)
    grid = (num_rows, splits)
    common = (vocab_size, out.stride(0), SAMPLING_EPS, span)
    settings = (temperature, top_k, top_p, min_p)
    block_s = triton.next_power_of_2(max(splits, row_programs))
    sizes = {"BLOCK_S": block_s, "num_warps": num_warps}
    # A radix pass holds a [HIST_BLOCK, 16] one-hot: as many elements as BLOCK.
    hist_block = max(block // _RADIX_BINS, 16)
    _scale_kernel[grid](
        src, out, split_max, temperature, vocab_size, src.stride(0), out.stride(0),
        SAMPLING_EPS, span, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    for radix_pass in range(8 if uses_top_k else 0):
        _top_k_pass_kernel[grid](
            out, hist_k, temperature, top_k, *common, radix_pass, HIST_BLOCK=hist_block,
            num_warps=num_warps,
        )  # fmt: skip
    if uses_top_p:
        _top_p_mass_kernel[grid](
            out, split_max, hist_k, mass, *settings, *common, BLOCK=block, **sizes
        )
        for radix_pass in range(8):
            _top_p_pass_kernel[grid](
                out, split_max, hist_k, mass, hist_p, *settings, *common, radix_pass,
                HIST_BLOCK=hist_block, **sizes,
            )  # fmt: skip
    _apply_masks_kernel[grid](
        out, row_max, split_max, hist_k, mass, hist_p, *settings, *common, BLOCK=block, **sizes
    )


def apply_sampling_masks_triton(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    splits: int | None = None,
) -> Tensor:
    """The Triton path of `apply_sampling_masks` (`splits`: see `_launch_masks`)."""
    out = logits.to(torch.float32, copy=True)
    row_max = torch.empty(out.shape[0], dtype=torch.float32, device=out.device)
    _launch_masks(out, out, row_max, temperature, top_k, top_p, min_p, splits)
    return out


def _top_p_keep_reference(e: Tensor, keep: Tensor, top_p: Tensor) -> Tensor:
    """Which tokens top-p keeps, given e = exp(s - max) and the tokens still in play.

    Token i is kept iff the mass of the tokens with e above its own is below the limit:
    the kept tokens are those with e at least a threshold v. Most rows of a peaked
    distribution find v among their _TOP_P_FIRST_TOKENS largest values
    (`_threshold_in_top`); the others in one bin of their values (`_threshold_by_bins`).
    For 64 rows of SmolLM2's logits on a 2-core Xeon with AMX (temperatures 0.3-1.5,
    top-p 0.5-0.999) the bins alone took 17-39 ms, where sorting every token above a floor
    of e took up to 0.1-0.27 s: real distributions' long tails left thousands of
    candidates a row.
    """
    e = torch.where(keep, e, 0.0)
    mass = _masses(e)
    limit = mass.sum(-1, keepdim=True).double() * top_p.double()[:, None]
    threshold, found = _threshold_in_top(e, limit)
    num_found = int(found.sum())
    if num_found * 2 < len(found):
        # Most rows left: binned whole, which costs less than copying them out.
        threshold = _threshold_by_bins(e, mass, limit)
    elif num_found < len(found):
        rows = _rows_where(~found)
        threshold[rows] = _threshold_by_bins(e[rows], mass[rows], limit[rows])
    return e >= threshold


def _threshold_in_top(e: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's threshold [R, 1] where its largest values hold it, and [R] whether they
    do: the tokens sorted down to the first whose mass above reaches the limit, as torch's
    topk returns them (ties in any order: the masses above a tie add up alike)."""
    vocab_size = e.shape[1]
    values = torch.topk(e, min(_TOP_P_FIRST_TOKENS, vocab_size), dim=-1).values
    last = _last_below_limit(values, limit, 0)
    # Found where a value past the last one kept was seen, or the row was taken whole.
    found = (last[:, 0] < values.shape[1] - 1) | (values.shape[1] == vocab_size)
    return values.gather(1, last), found


def _threshold_by_bins(e: Tensor, mass: Tensor, limit: Tensor) -> Tensor:
    """Each row's threshold [R, 1], found in one bin of the row's values by the high bits
    of their float32 image (exponent and first mantissa bits, an order-preserving bucketing
    of e in [0, 1]): one pass adds each bin's mass up; the bins whose mass, with everything
    above them, reaches the limit end at the threshold's bin; only that bin's tokens are
    sorted."""
    num_rows = e.shape[0]
    # e >= 0: its bits order it (a NaN, from infinite logits, goes to the top bin).
    bins = (e.view(torch.int32) >> _TOP_P_BIN_SHIFT).clamp_(max=_TOP_P_BINS - 1)
    # Added up row by row (scatter_add_ along the rows runs them in parallel: 1.9-3.9 ms
    # for 64 rows of 49,152 tokens against 7.8-10 for one index_add_ over them all).
    bin_mass = torch.zeros((num_rows, _TOP_P_BINS), dtype=torch.int64, device=e.device)
    bin_mass.scatter_add_(1, bins.long(), mass)
    # from_top[:, b]: the mass in bin b and above; a last column of zeros (above the top).
    from_top = bin_mass.flip(-1).cumsum(-1).flip(-1)
    from_top = torch.cat([from_top, from_top.new_zeros(num_rows, 1)], dim=-1)
    # The threshold's bin: the highest whose mass and everything above reach the limit.
    # The bins above it hold less than the limit together, so all their tokens are kept;
    # the bins below, at least the limit above each token, so none of theirs.
    boundary = (from_top.double() >= limit).sum(-1, keepdim=True) - 1
    above_boundary = from_top.gather(1, boundary + 1)
    rows, cols = (bins == boundary.to(torch.int32)).nonzero(as_tuple=True)
    # The boundary bin's tokens laid out one row each, padded with zeros, each row sorted.
    counts = torch.bincount(rows, minlength=num_rows)
    position = torch.arange(rows.numel(), device=e.device) - (counts.cumsum(0) - counts)[rows]
    candidates = e.new_zeros((num_rows, int(counts.max())))
    candidates.index_put_((rows, position), e[rows, cols])
    sorted_values = torch.sort(candidates, dim=-1, descending=True).values
    # The padding sees the whole bin's mass above it, which reaches the limit; the bin's
    # first token has only the bins above before it, so its position always counts.
    return sorted_values.gather(1, _last_below_limit(sorted_values, limit, above_boundary))


def _last_below_limit(sorted_values: Tensor, limit: Tensor, above: Tensor | int) -> Tensor:
    """[R, 1]: in rows of values sorted down, the last position whose mass above (the mass
    sorted before it, plus `above`, what lies above the values given) is below the limit.
    That mass only grows along a row, so the positions below the limit are a prefix; the
    value at its end is the threshold (tokens equal to it are kept with it)."""
    mass = _masses(sorted_values)
    mass_above = (above + mass.cumsum(-1) - mass).double()
    return (mass_above < limit).sum(-1, keepdim=True) - 1


def _masses(e: Tensor) -> Tensor:
    """e's probability mass, in int64 multiples of 2**-40 (truncated)."""
    return (e * _MASS_SCALE).to(torch.int64)


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
