"""FP8 W8A8 linear layers (vLLM's `fp8`): the weight quantizer and the torch reference.

An FP8 layer holds its weight W [N, K] as 8-bit floats W_q with float32 scales, one for
the whole tensor or one per output row: W ≈ W_q · s_w. Its input is quantized as it comes,
one scale per row ("dynamic per-token"): s_x[m] = max_k |x[m, k]| / FP8_MAX and
x_q = x / s_x rounded to the nearest 8-bit float. The layer computes

    y[m, n] = s_x[m] · s_w[n] · Σ_k x_q[m, k] · W_q[n, k]  (+ bias[n])

with float32 sums: products of two 8-bit floats are exact in float32, so the result only
depends on the order of the sums.

The 8-bit format is e4m3: `float8_e4m3fn` (NVIDIA and the CPU; largest finite 448) or, on
AMD's MI300 (gfx942), `float8_e4m3fnuz` (largest finite 240: the same bits mean half the
value). A checkpoint's e4m3fn weights move to fnuz by reinterpreting their bits and
doubling their scale (`to_e4m3fnuz`).

`fp8_linear_reference` is the oracle of the Triton kernels (fp8_linear.py). On the CPU
the model runs on weights dequantized at load: torch's `_scaled_mm` on the CPU took ~40×
the time of a bfloat16 product at SmolLM2's shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
FP8_DTYPES = tuple(FP8_MAX)
# The least scale of a row: a row of zeros gets this instead of 0 (which would give 0/0).
MIN_SCALE = 1.0 / (448.0 * 512.0)


def check_fp8_dtype(dtype: torch.dtype) -> float:
    """The largest finite value of e4m3 type `dtype`; ValueError for another type."""
    if dtype not in FP8_MAX:
        raise ValueError(f"not an e4m3 type: {dtype}; expected one of {FP8_DTYPES}")
    return FP8_MAX[dtype]


def quantize_rows(x: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [M, K] as `fp8_dtype` with one float32 scale a row, [M]: x ≈ x_q · scale[:, None]."""
    fp8_max = check_fp8_dtype(fp8_dtype)
    x = x.float()
    scale = (x.abs().amax(dim=1) / fp8_max).clamp(min=MIN_SCALE)
    # The clamp catches the last bit of the division's rounding: past the largest finite
    # value, torch's cast to e4m3fn gives NaN.
    x_q = (x / scale[:, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return x_q, scale


def quantize_weight(
    weight: Tensor, fp8_dtype: torch.dtype, per_channel: bool = True
) -> tuple[Tensor, Tensor]:
    """W [N, K] as `fp8_dtype` and its float32 scales: [N] per output row, or [1] for the
    whole tensor (what `--quantization fp8` makes of a 16-bit checkpoint at load)."""
    if per_channel:
        return quantize_rows(weight, fp8_dtype)
    fp8_max = check_fp8_dtype(fp8_dtype)
    weight = weight.float()
    scale = (weight.abs().amax() / fp8_max).clamp(min=MIN_SCALE).reshape(1)
    return (weight / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


def to_e4m3fnuz(weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3fn weights and scales as e4m3fnuz ones of the same values: the bits reinterpreted
    (an fnuz number is half the fn number of the same bits) and the scales doubled. The fn
    bit pattern of −0 is fnuz's NaN, so it becomes +0."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected float8_e4m3fn weights, got {weight.dtype}")
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale.float() * 2


def dequantize(weight: Tensor, scale: Tensor) -> Tensor:
    """Float32 W [N, K] from fp8 W_q [N, K] and its scales ([N] or [1])."""
    return weight.float() * scale.float().reshape(-1, 1)


def check_fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError when x, the fp8 weight, its scales and the bias do not fit together."""
    check_fp8_dtype(weight.dtype)
    check_scaled_operands(x, weight, scale, bias)


def check_scaled_operands(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError when x [M, K], an 8-bit weight [N, K] (FP8 or INT8), its float32
    scales ([1] or [N]) and the bias [N] do not fit together."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"x must be [M, {k}] for a weight of {tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.shape[0] not in (1, n):
        raise ValueError(
            f"weight scale must be float32 [1] or [{n}], got {scale.dtype} {tuple(scale.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def fp8_linear_reference(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) with W = weight · scale in 8-bit floats and x quantized per row
    to the same format, in float32, cast to x's dtype."""
    check_fp8_linear(x, weight, scale, bias)
    x_q, x_scale = quantize_rows(x, weight.dtype)
    out = (x_q.float() @ weight.float().t()) * x_scale[:, None] * scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
