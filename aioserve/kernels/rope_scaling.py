"""RoPE scaling: the inverse frequencies of each `rope_scaling` type, as transformers
computes them (`transformers.modeling_rope_utils`), so that float32 tables match its own.

"default" (none), "linear" (positions divided by `factor`), "dynamic" (NTK: a larger
base, fixed at the longest context the factor allows), "llama3" (Llama 3.1's wavelength
bands), "yarn" (interpolation blended across a band of dimensions, and an attention
factor that scales cos and sin) and "longrope" (Phi-3's LongRoPE: each frequency divided
by a factor of its own, from `short_factor` or `long_factor`, and an attention factor).
`inverse_frequencies` returns the frequencies and that factor (1 except for YaRN and
LongRoPE); kernels/rotary.py turns them into the cos/sin table.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def inverse_frequencies(
    rotary_dim: int, base: float, rope_scaling: dict | None, context_length: int | None = None
) -> tuple[Tensor, float]:
    """transformers' inverse frequencies for `rope_scaling`, in float32 on the CPU, and the
    factor its cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1 for
    the others). `context_length`, the model's max_position_embeddings, gives LongRoPE's
    attention factor where its scaling has no `factor`."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "dynamic":
        base = _dynamic_ntk_base(rotary_dim, base, scaling["factor"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        # Dividing the frequencies by the factor is dividing the positions by it; this is
        # the order transformers uses, so float32 results agree bit for bit.
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, base, scaling)
    if rope_type == "longrope":
        return _longrope_inverse_frequencies(rotary_dim, base, scaling, context_length)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}: aioserve implements default, linear, "
        "dynamic, llama3, yarn and longrope"
    )


# Set in a longrope scaling dict (rope_parameters.choose_longrope_factors) when the served
# context is longer than the original one: the long factors, for every position.
LONG_FACTORS_KEY = "aioserve_long_factors"


def _longrope_inverse_frequencies(
    rotary_dim: int, base: float, scaling: dict, context_length: int | None
) -> tuple[Tensor, float]:
    """LongRoPE (transformers' `_compute_longrope_parameters`, vLLM's
    Phi3LongRoPEScaledRotaryEmbedding): frequency i divided by the i-th of the short or long
    factors, cos and sin scaled by an attention factor: the chosen set's `short_mscale` /
    `long_mscale`, else `attention_factor`, else sqrt(1 + ln(factor) / ln(original
    context)), factor being the context's stretch.

    transformers takes the long factors for a forward pass whose sequence is longer than
    the original context, the short ones otherwise; a paged cache keeps each key rotated
    once, so here, as in vLLM, one set serves every position: the long one where
    LONG_FACTORS_KEY says so, which the engine sets when the served context
    (--max-model-len) is longer than the original one."""
    original_context = scaling.get("original_max_position_embeddings")
    if not original_context:
        raise ValueError("a longrope rope_scaling needs original_max_position_embeddings")
    long = bool(scaling.get(LONG_FACTORS_KEY))
    chosen = "long_factor" if long else "short_factor"
    ext_factors = torch.tensor(scaling[chosen], dtype=torch.float32)
    if ext_factors.shape != (rotary_dim // 2,):
        raise ValueError(
            f"rope_scaling {chosen} has {ext_factors.numel()} values; the rotary dimensions "
            f"need {rotary_dim // 2}"
        )
    factor = scaling.get("factor") or (context_length or original_context) / original_context
    # Phi-3's first configs name the chosen set's own factor (vLLM reads them); newer ones
    # an attention_factor (transformers 5 reads it); most neither.
    attention_factor = scaling.get("long_mscale" if long else "short_mscale")
    if attention_factor is None:
        attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_context))
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext_factors * base**exponents), float(attention_factor)


def _dynamic_ntk_base(rotary_dim: int, base: float, factor: float) -> float:
    """The base of dynamic NTK scaling at the longest context it allows (the original
    context times `factor`): transformers' `_compute_dynamic_ntk_parameters` at that length.

    transformers recomputes the base on every forward pass from the current length, which
    would rotate a sequence's cached keys by angles its later tokens no longer use; a paged
    cache keeps each key rotated once, so the base is fixed here, as vLLM fixed it.
    """
    return base * (factor * factor - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def _yarn_inverse_frequencies(rotary_dim: int, base: float, scaling: dict) -> tuple[Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`, vLLM's YaRNScalingRotaryEmbedding):
    frequencies interpolated by `factor` below a band of dimensions, kept above it, blended
    linearly across it; cos and sin scaled by the attention factor."""
    factor = scaling["factor"]
    original_context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original_context / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 where the frequency is kept (extrapolated), 0 where interpolated
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - kept) + extrapolated * kept, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_inverse_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1's frequency scaling (transformers' `_compute_llama3_parameters`).

    Long wavelengths are slowed down by `factor`, short ones kept, and the band between
    interpolated smoothly.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)
