"""The sampler: from one step's logits to one token per sequence, plus its logprobs.

The runner calls `sample(logits, batch)` once per step with the logits of the rows that
sample (one row per sequence) and their settings gathered in a `SamplingBatch`. The steps
follow vLLM v1's order:

1. The values logprobs report, if any row asked for logprobs, as `batch.logprobs_mode`
   (vLLM's --logprobs-mode) says: "raw_logprobs" (the default), the log_softmax of the
   float32 logits before any processing, or "raw_logits", those logits themselves. The
   processed modes take theirs after step 5 instead (see step 6).
2. Logit bias: per-row (token id, value) pairs, added; -inf values ban tokens (the engine
   uses them for min_tokens). A token listed twice gets both values. After step 3, the
   token bitmasks of constrained rows (allowed_token_ids, structured outputs) set every
   token whose bit is unset to -inf (`token_bitmask`); a ban is a ban in either order.
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
6. Logprobs from the values of step 1, or in the processed modes from the logits the
   draw saw: after steps 2-3 for every row, and for random rows then scaled by the
   temperature with the tokens the masks drop at -inf ("processed_logits"), or the
   log_softmax of those ("processed_logprobs"); the draw is the same in every mode.
   Reported: the sampled token's value, its rank (1 + the number of tokens with a
   strictly higher value, counted before any log_softmax) and the top `num_logprobs`
   (descending, ties by lower token id).

The uniforms `U_i` come from a counter-based hash of (seed, step, token id) in 32-bit
integer arithmetic (held in int64 with multipliers below 2**31, so nothing overflows) that
the Triton kernels and the torch reference compute identically. Every reduction is per
row in a fixed order, so a seeded sequence draws the same tokens whatever else shares
its batch. The two paths agree token for token where their exp and log agree, as in
Triton's CPU interpreter; a GPU's fast exp differs from torch's in the last bits, which
can flip a near-tie between the GPU kernels and the CPU reference (rarely), never the
result of one device from run to run.

Each step has Triton kernels (one program per row walking the vocabulary in blocks, except
the masks, which split a row over several programs at small batch and find the top-k and
top-p thresholds without sorting, by radix select over the order-preserving integer image
of float32 values) and a plain-torch reference, which is the execution path on the CPU.
`sample` picks one with `dispatch.use_triton()`.

Modules, one stage each: `penalties` (steps 2-3), `masks` (step 5 without the draw),
`uniform` (the hash), `race` (the torch path's draw: the race, greedy's argmax),
`sampler` (the Triton draw and the whole pipeline), `logprobs` (step 6),
`token_bitmask` (the bitmasks of step 2), `common` (the batch and result types).
"""

from aioserve.kernels.sampling.common import (
    LOGPROBS_MODES,
    SAMPLING_EPS,
    LogprobsTensors,
    SamplerOutput,
    SamplingBatch,
    make_sampling_batch,
)
from aioserve.kernels.sampling.logprobs import compute_logprobs
from aioserve.kernels.sampling.masks import apply_sampling_masks
from aioserve.kernels.sampling.penalties import apply_bias_and_penalties
from aioserve.kernels.sampling.sampler import sample

__all__ = [
    "LOGPROBS_MODES",
    "SAMPLING_EPS",
    "LogprobsTensors",
    "SamplerOutput",
    "SamplingBatch",
    "apply_bias_and_penalties",
    "apply_sampling_masks",
    "compute_logprobs",
    "make_sampling_batch",
    "sample",
]
