"""The sampler: from one step's logits to one token per sequence, plus its logprobs.

The runner calls `sample(logits, batch)` once per step with the logits of the rows that
sample (one row per sequence) and their settings gathered in a `SamplingBatch`. The steps
follow vLLM v1's order:

1. Raw logprobs, if any row asked for logprobs: log_softmax of the float32 logits before
   any processing (vLLM's default "raw_logprobs").
2. Logit bias: per-row (token id, value) pairs, added; -inf values ban tokens (the engine
   uses them for min_tokens and allowed_token_ids). A token listed twice gets both values.
3. Penalties over the float32 logits, vLLM's definitions: repetition penalty on tokens
   seen in the prompt or the output (`l > 0 ? l / rp : l * rp`), then
   `l -= frequency_penalty * count_in_output`, then `l -= presence_penalty * (count > 0)`.
4. Greedy rows (temperature below 1e-5): argmax, the first index among equal maxima.
5. Random rows: `s = l / temperature`, `m = max(s)`, `e = exp(s - m)` (the probabilities
   up to a per-row factor; the most likely token has e = 1). Then
   min-p keeps `e >= min_p`; top-k keeps `s >= k-th largest s` (ties at the boundary
   kept); top-p keeps token i iff the probability of the tokens still in play that are
   strictly more probable than i is below `top_p` (the smallest set reaching `top_p`,
   ties at the boundary kept). Probability mass is summed in 2**-40 fixed point, so the
   sums, hence the masks, do not depend on summation order. Finally the token is drawn
   by the exponential race: `argmax_i e_i / E_i` with `E_i = -log(U_i)`, which picks i
   with probability proportional to e_i over the kept tokens.
6. Logprobs from the raw logprobs of step 1: the sampled token's, its rank (1 + the
   number of tokens with a strictly higher raw logit) and the top `num_logprobs`
   (descending, ties by lower token id).

The uniforms `U_i` come from a counter-based hash of (seed, step, token id) in 32-bit
integer arithmetic (held in int64 with multipliers below 2**31, so nothing overflows) that
the Triton kernels and the torch reference compute identically. Every reduction is per
row in a fixed order, so a seeded sequence draws the same tokens whatever else shares
its batch. The two paths agree token for token where their exp and log agree, as in
Triton's CPU interpreter; a GPU's fast exp differs from torch's in the last bits, which
can flip a near-tie between the GPU kernels and the CPU reference (rarely), never the
result of one device from run to run.

Each step has a Triton kernel (one program per row, walking the vocabulary in blocks:
top-k and top-p thresholds are found without sorting, by bisection over the
order-preserving integer image of float32 values) and a plain-torch reference, which is
the execution path on the CPU. `sample` picks one with `dispatch.use_triton()`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import current_platform

# Rows whose temperature is below this are greedy (SamplingParams uses the same bound).
SAMPLING_EPS = 1e-5

# Probability mass is summed as int64 multiples of 2**-40 (see the module docstring).
_MASS_SCALE = float(2**40)

# The reference only hashes tokens within this much of the row's largest scaled logit. A token further below has e < exp(-20) ~ 2.1e-9, and E >= -log(1 - 2**-24)
# ~ 6e-8, so its race score e/E < 0.035; the best token (e = 1) scores at least
# 1 / -log(2**-24) ~ 0.06. Such a token can never win, so skipping it changes nothing.
_RACE_CUTOFF = 20.0

# The dense race walks this many (row, token) pairs at a time, so its temporaries stay in
# the CPU's cache.
_DENSE_CHUNK_ELEMENTS = 2**18

# When every random row has a top-k of at most this, the reference works on the top-k
# tokens alone.
_SMALL_TOP_K = 1024

# The reference's top-p sorts only the tokens with e >= this floor, lowering it (2**-20,
# 2**-30, ..., then 0) until they hold the top_p mass; most rows need only the first.
_TOP_P_FIRST_FLOOR = 2.0**-10

# Per platform: the widest slice of a row one program holds at a time, how many row
# elements one warp/wavefront should cover, and the most warps per program. A ROCm
# wavefront has 64 lanes, so it covers twice as much.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_block": 4096, "elements_per_warp": 512, "max_warps": 8},
    "rocm": {"max_block": 4096, "elements_per_warp": 1024, "max_warps": 8},
    "cpu": {"max_block": 1024, "elements_per_warp": 256, "max_warps": 1},
}


@dataclass
class SamplingBatch:
    """One step's sampling settings, one row per sampled sequence, on the logits' device."""

    temperature: Tensor  # [B] float32; below SAMPLING_EPS (e.g. 0.0) means greedy
    top_k: Tensor  # [B] int32; <= 0 or >= vocab means no top-k
    top_p: Tensor  # [B] float32; 1.0 means no top-p
    min_p: Tensor  # [B] float32; 0.0 means no min-p
    seeds: Tensor  # [B] int64; every row has one (the engine draws it if unseeded)
    steps: Tensor  # [B] int64; index of the token being sampled in the request's output
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    output_token_counts: Tensor | None  # [B, V] int32; None when no row uses penalties
    prompt_token_mask: Tensor | None  # [B, V] bool; None when no row uses repetition_penalty
    bias_token_ids: Tensor | None  # [B, K] int64, padded with -1
    bias_values: Tensor | None  # [B, K] float32; -inf bans the token
    num_logprobs: int  # most top logprobs asked for in the batch; 0: none; -1: no logprobs
    all_greedy: bool
    all_random: bool


@dataclass
class LogprobsTensors:
    sampled_logprob: Tensor  # [B] float32: raw logprob of the sampled token
    sampled_rank: Tensor  # [B] int64: 1 + number of tokens with a strictly higher raw logit
    top_token_ids: Tensor  # [B, num_logprobs] int64, by descending logprob, ties by lower id
    top_logprobs: Tensor  # [B, num_logprobs] float32


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # when num_logprobs >= 0


def make_sampling_batch(
    num_rows: int,
    *,
    device: torch.device | str = "cpu",
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = -1,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    seeds: int | Sequence[int] = 0,
    steps: int | Sequence[int] = 0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float] = 1.0,
    output_token_counts: Tensor | None = None,
    prompt_token_mask: Tensor | None = None,
    logit_bias: Sequence[Mapping[int, float]] | None = None,
    num_logprobs: int = -1,
) -> SamplingBatch:
    """A SamplingBatch from per-row values (a scalar applies to every row); for tests."""

    def rows(value: float | Sequence[float], dtype: torch.dtype) -> Tensor:
        values = [value] * num_rows if isinstance(value, (int, float)) else list(value)
        return torch.tensor(values, dtype=dtype, device=device)

    temperature_t = rows(temperature, torch.float32)
    bias_ids = bias_values = None
    width = max((len(b) for b in logit_bias), default=0) if logit_bias is not None else 0
    if width:
        bias_ids = torch.full((num_rows, width), -1, dtype=torch.int64)
        bias_values = torch.zeros((num_rows, width), dtype=torch.float32)
        for row, bias in enumerate(logit_bias):
            bias_ids[row, : len(bias)] = torch.tensor(list(bias.keys()), dtype=torch.int64)
            bias_values[row, : len(bias)] = torch.tensor(list(bias.values()))
        bias_ids, bias_values = bias_ids.to(device), bias_values.to(device)
    return SamplingBatch(
        temperature=temperature_t,
        top_k=rows(top_k, torch.int32),
        top_p=rows(top_p, torch.float32),
        min_p=rows(min_p, torch.float32),
        seeds=rows(seeds, torch.int64),
        steps=rows(steps, torch.int64),
        presence_penalty=rows(presence_penalty, torch.float32),
        frequency_penalty=rows(frequency_penalty, torch.float32),
        repetition_penalty=rows(repetition_penalty, torch.float32),
        output_token_counts=output_token_counts,
        prompt_token_mask=prompt_token_mask,
        bias_token_ids=bias_ids,
        bias_values=bias_values,
        num_logprobs=num_logprobs,
        all_greedy=bool((temperature_t < SAMPLING_EPS).all()),
        all_random=bool((temperature_t >= SAMPLING_EPS).all()),
    )


# ---------------------------------------------------------------------------------------
# The hash behind the uniforms. Values are 32-bit, held in int64. Both multipliers are
# below 2**31, so a product with a 32-bit value stays below 2**63: no overflow anywhere.
# The mixer is "lowbias32" (Chris Wellons' hash-prospector), a bijection on 32 bits.
# ---------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_MUL_A = 0x21F0AAAD
_MUL_B = 0x735A2D97
_SEED_SALT = 0x1B873593


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, step):
    key = _mix32((seed & 0xFFFFFFFF) ^ 0x1B873593)
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
    return _mix32(key ^ (step & 0xFFFFFFFF))


@triton.jit
def _uniform(key, cols):
    # An odd multiple of 2**-24 in (0, 1): exact in float32, never 0 or 1.
    h = _mix32(key ^ cols.to(tl.int64))
    return ((h >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)


def _mix32_reference(x: Tensor) -> Tensor:
    """`_mix32` on an int64 tensor of 32-bit values (updated in place and returned)."""
    x ^= x >> 16
    x.mul_(_MUL_A).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MUL_B).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def _row_key_reference(seeds: Tensor, steps: Tensor) -> Tensor:
    key = _mix32_reference((seeds & _MASK32) ^ _SEED_SALT)
    key = _mix32_reference(key ^ ((seeds >> 32) & _MASK32))
    return _mix32_reference(key ^ (steps & _MASK32))


def _uniform_reference(keys: Tensor, cols: Tensor) -> Tensor:
    h = _mix32_reference(keys ^ cols)
    return ((h >> 8) | 1).to(torch.float32) * 2.0**-24


# ---------------------------------------------------------------------------------------
# Triton kernels: one program per row, walking the vocabulary in BLOCK-wide slices.
# Divisions use tl.math.div_rn, rounded as torch's are: a plain `/` in Triton compiles to
# an approximate division on NVIDIA GPUs.
# ---------------------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    # float32 -> int32 with the same order (and -0.0, +0.0 both mapped to 0).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


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
    HAS_PENALTIES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    out_row = out_ptr + row * stride_out
    counts_row = counts_ptr + row * stride_counts
    prompt_row = prompt_mask_ptr + row * stride_prompt
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

        # Top-k: the order key of the k-th largest value is the largest t with
        # count(key >= t) >= k. Bisection over the int32 keys of -inf..+inf.
        top_k_key = tl.full([], -0x7F800000, tl.int64)
        if (top_k > 0) & (top_k < vocab_size):
            lo = tl.full([], -0x7F800000, tl.int64)
            hi = tl.full([], 0x7F800000, tl.int64)
            for _ in range(32):
                mid = lo + ((hi - lo + 1) >> 1)
                count = tl.zeros([BLOCK], dtype=tl.int32)
                for start in range(0, vocab_size, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < vocab_size
                    s = tl.load(out_row + cols, mask=mask, other=0.0)
                    count += (mask & (_order_key(s) >= mid)).to(tl.int32)
                enough = tl.sum(count, axis=0) >= top_k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            top_k_key = lo

        # Top-p over the tokens min-p and top-k keep: the smallest bit pattern b of a
        # probability such that the mass strictly above b is below top_p * total. The
        # kept tokens are those whose e has bits >= b. Bisection over [0, bits(1.0)].
        # Masses are int64 multiples of 2**-40 (1099511627776.0 = _MASS_SCALE).
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
            lo = tl.full([], 0, tl.int64)
            hi = tl.full([], 0x3F800000, tl.int64)
            for _ in range(30):
                mid = (lo + hi) >> 1
                above = tl.zeros([BLOCK], dtype=tl.int64)
                for start in range(0, vocab_size, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < vocab_size
                    s = tl.load(out_row + cols, mask=mask, other=float("-inf"))
                    e = tl.exp(s - row_max)
                    kept = mask & (_order_key(s) >= top_k_key) & (e >= min_p)
                    kept = kept & (e.to(tl.int32, bitcast=True) > mid)
                    above += tl.where(kept, (e * 1099511627776.0).to(tl.int64), 0)
                below_limit = tl.sum(above, axis=0).to(tl.float64) < limit
                hi = tl.where(below_limit, mid, hi)
                lo = tl.where(below_limit, lo, mid + 1)
            top_p_bits = lo

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


# ---------------------------------------------------------------------------------------
# Launchers (the Triton path).
# ---------------------------------------------------------------------------------------


def _launch_config(width: int) -> tuple[int, int]:
    """Block size and warps for a row walk over `width` elements."""
    config = _CONFIG[current_platform()]
    block = min(triton.next_power_of_2(width), config["max_block"])
    num_warps = max(1, min(config["max_warps"], block // config["elements_per_warp"]))
    return block, num_warps


def _rows(t: Tensor) -> Tensor:
    """`t` with unit stride along its last dimension (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _needs_processing(batch: SamplingBatch) -> bool:
    return (
        batch.output_token_counts is not None
        or batch.prompt_token_mask is not None
        or batch.bias_token_ids is not None
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
        HAS_PENALTIES=counts is not None or prompt_mask is not None,
        HAS_BIAS=num_bias > 0,
        BLOCK=block,
        BLOCK_BIAS=min(triton.next_power_of_2(max(num_bias, 1)), 1024),
        num_warps=num_warps,
        # No fused multiply-add: `x - penalty * count` rounds as the reference's does.
        enable_fp_fusion=False,
    )
    return out


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


def compute_logprobs_triton(
    logits: Tensor, token_ids: Tensor, num_logprobs: int
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
    return result


def sample_triton(logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
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
    masked = processed  # what the sample kernel reads for random rows (none if all greedy)
    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
    if not batch.all_greedy:
        if processed is logits:  # never write into the caller's logits
            masked = torch.empty_like(logits, dtype=torch.float32)
        # Otherwise in place: the kernel leaves greedy rows as they are.
        _launch_masks(
            processed, masked, row_max, batch.temperature, batch.top_k, batch.top_p, batch.min_p
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
    logprobs = None
    if batch.num_logprobs >= 0:
        logprobs = compute_logprobs_triton(logits, token_ids, batch.num_logprobs)
    return SamplerOutput(token_ids, logprobs)


# ---------------------------------------------------------------------------------------
# The torch reference (the CPU path).
# ---------------------------------------------------------------------------------------


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


def _rows_where(flags: Tensor) -> slice | Tensor:
    """Index of the rows where `flags` holds: a slice (no copy) when it holds for all."""
    return slice(None) if bool(flags.all()) else flags.nonzero().squeeze(1)


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


def _race_reference(s: Tensor, row_max: Tensor, keep: Tensor | None, keys: Tensor) -> Tensor:
    """The exponential race over the kept tokens of each row of `s`; the winners' ids.

    Only tokens that can win are hashed (see _RACE_CUTOFF). When they are few (top-p,
    min-p, peaked distributions) they are gathered; otherwise the rows are walked densely
    in cache-sized chunks. Both give the Triton kernel's answer.
    """
    candidates = s > row_max - _RACE_CUTOFF
    if keep is not None:
        candidates &= keep
    if int(candidates.count_nonzero()) * 4 < candidates.numel():
        return _race_sparse_reference(s, row_max, candidates, keys)
    return _race_dense_reference(s, row_max, candidates, keys)


def _race_sparse_reference(s: Tensor, row_max: Tensor, candidates: Tensor, keys: Tensor) -> Tensor:
    rows, cols = candidates.nonzero(as_tuple=True)
    return _race_among(rows, cols, s[rows, cols], row_max, keys)


def _race_among(
    rows: Tensor, cols: Tensor, s_values: Tensor, row_max: Tensor, keys: Tensor
) -> Tensor:
    """The race over the listed (row, token id, scaled logit) triples; a winner per row."""
    u = _uniform_reference(keys[rows], cols)
    score = torch.exp(s_values - row_max[rows, 0]) / u.log_().neg_()
    num_rows = row_max.shape[0]
    best = torch.zeros(num_rows, dtype=torch.float32, device=score.device)
    best = best.scatter_reduce(0, rows, score, "amax", include_self=False)
    winners = torch.where(score == best[rows], cols, torch.iinfo(torch.int64).max)
    # A row without candidates (all -inf) gets token 0, as in the kernel.
    token_ids = torch.zeros(num_rows, dtype=torch.int64, device=score.device)
    return token_ids.scatter_reduce(0, rows, winners, "amin", include_self=False)


def _sample_within_top_k_reference(
    s: Tensor, row_max: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor
) -> Tensor | None:
    """The draw when every row has a top-k of at most _SMALL_TOP_K; None otherwise.

    Min-p, top-p and the race then only concern the top-k tokens, so they run on those
    alone instead of the whole vocabulary. Also None when a tie at a row's k-th value
    reaches past the k tokens torch.topk picked (they would all be kept).
    """
    vocab_size = s.shape[1]
    if not bool(((top_k > 0) & (top_k <= _SMALL_TOP_K) & (top_k < vocab_size)).all()):
        return None
    # One more than the largest k, to see whether a row's (k+1)-th value ties its k-th.
    k = top_k.long()[:, None]
    values, ids = torch.topk(s, int(k.max()) + 1, dim=-1)
    if not bool((values.gather(1, k) < values.gather(1, k - 1)).all()):
        return None
    e = torch.exp(values - row_max)
    keep = (torch.arange(values.shape[1], device=s.device) < k) & (e >= min_p[:, None])
    uses_top_p = top_p < 1.0
    if bool(uses_top_p.any()):
        rows = _rows_where(uses_top_p)
        keep[rows] &= _top_p_keep_reference(e[rows], keep[rows], top_p[rows])
    rows, slots = (keep & (values > row_max - _RACE_CUTOFF)).nonzero(as_tuple=True)
    return _race_among(rows, ids[rows, slots], values[rows, slots], row_max, keys)


def _race_dense_reference(s: Tensor, row_max: Tensor, candidates: Tensor, keys: Tensor) -> Tensor:
    num_rows, vocab_size = s.shape
    cols = torch.arange(vocab_size, dtype=torch.int64, device=s.device)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=s.device)
    chunk = max(1, _DENSE_CHUNK_ELEMENTS // vocab_size)
    for start in range(0, num_rows, chunk):
        rows = slice(start, start + chunk)
        u = _uniform_reference(keys[rows, None], cols)
        e = torch.exp(s[rows] - row_max[rows]).masked_fill_(~candidates[rows], 0.0)
        token_ids[rows] = e.div_(u.log_().neg_()).argmax(dim=-1)
    return token_ids


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
    logits: Tensor, token_ids: Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The torch path of `compute_logprobs`."""
    x = logits.float()
    if num_logprobs > x.shape[1]:
        raise ValueError(f"num_logprobs={num_logprobs} exceeds the vocabulary ({x.shape[1]})")
    log_sum_exp = torch.logsumexp(x, dim=-1)
    token_logit = x.gather(1, token_ids[:, None])
    top_ids, top_values = _top_n_reference(x, num_logprobs)
    return LogprobsTensors(
        sampled_logprob=token_logit.squeeze(1) - log_sum_exp,
        sampled_rank=1 + (x > token_logit).sum(-1),
        top_token_ids=top_ids,
        top_logprobs=top_values - log_sum_exp[:, None],
    )


def sample_reference(logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
    """The torch path of `sample`."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        token_ids = torch.empty(0, dtype=torch.int64, device=logits.device)
        return SamplerOutput(token_ids, _empty_logprobs(batch, logits.device))
    x = apply_bias_and_penalties_reference(logits, batch)
    if batch.all_random:
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    else:
        token_ids = x.argmax(dim=-1)
    if not batch.all_greedy:
        rows = _rows_where(batch.temperature >= SAMPLING_EPS)
        s = x[rows] / batch.temperature[rows, None]
        row_max = s.amax(-1, keepdim=True)
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        keys = _row_key_reference(batch.seeds[rows], batch.steps[rows])
        drawn = _sample_within_top_k_reference(s, row_max, top_k, top_p, min_p, keys)
        if drawn is None:
            keep = _keep_mask_reference(s, row_max, top_k, top_p, min_p)
            drawn = _race_reference(s, row_max, keep, keys)
        token_ids[rows] = drawn
    logprobs = None
    if batch.num_logprobs >= 0:
        logprobs = compute_logprobs_reference(logits, token_ids, batch.num_logprobs)
    return SamplerOutput(token_ids, logprobs)


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


# ---------------------------------------------------------------------------------------
# Public entry points: Triton on CUDA/ROCm, the reference on the CPU.
# ---------------------------------------------------------------------------------------


def sample(logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of `logits` [B, V] (any float dtype) as `batch` says.

    Returns the token ids and, when `batch.num_logprobs >= 0`, their raw logprobs, rank
    and the top `num_logprobs` alternatives. `logits` is left untouched.
    """
    if dispatch.use_triton():
        return sample_triton(logits, batch)
    return sample_reference(logits, batch)


def apply_bias_and_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 2-3: float32 logits with the logit bias added, then the penalties applied."""
    if dispatch.use_triton():
        return apply_bias_and_penalties_triton(logits, batch)
    return apply_bias_and_penalties_reference(logits, batch)


def apply_sampling_masks(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """Step 5 without the draw: float32 logits / temperature, -inf where a mask drops them.

    Rows with a temperature below SAMPLING_EPS (greedy) are returned unscaled and unmasked.
    """
    if dispatch.use_triton():
        return apply_sampling_masks_triton(logits, temperature, top_k, top_p, min_p)
    return apply_sampling_masks_reference(logits, temperature, top_k, top_p, min_p)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: int) -> LogprobsTensors:
    """Raw logprobs (log_softmax of the float32 logits) of `token_ids` and the top n."""
    if dispatch.use_triton():
        return compute_logprobs_triton(logits, token_ids, num_logprobs)
    return compute_logprobs_reference(logits, token_ids, num_logprobs)
