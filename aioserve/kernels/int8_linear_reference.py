"""INT8 W8A8 linear layers (compressed-tensors' `int-quantized`): the CPU's product and the
oracle of the Triton kernels (int8_linear.py).

An INT8 layer holds its weight W [N, K] as 8-bit integers W_q in [-127, 127] with float32
scales, one per output row or one for the whole tensor: W ≈ W_q · s_w (symmetric: no zero
point). Its input is quantized as it comes, one scale per row ("dynamic per-token"):
s_x[m] = max_k |x[m, k]| / 127 and x_q = x / s_x rounded to the nearest integer, ties to
even. The layer computes

    y[m, n] = s_x[m] · s_w[n] · Σ_k x_q[m, k] · W_q[n, k]  (+ bias[n])

where the sum is an exact int32 (|Σ| ≤ 127² · K, below 2³¹ for K up to 133,000), so every
backend that rounds x the same way gets the same integers; only the float32 scaling after
it is rounded.

On the CPU the integer product is torch's `_int_mm` (oneDNN's int8 GEMM, VNNI or AMX where
the CPU has them): at SmolLM2's shapes on a Zen 5 EPYC it ran a 4,096-row product in about
half the time of the bfloat16 one, and a 64-row one in 0.6-0.9 of it (bench/RESULTS.md).
Without VNNI (an AVX2-only EPYC, a Skylake Xeon; or ONEDNN_MAX_CPU_ISA=AVX2) oneDNN adds
pairs of byte products in 16 bits, which saturate: 127 · -128 summed over 576 inputs came
out 0. `int8_gemm_exact` checks that once; where it fails the integers are summed in
float64 instead (exact, and slow: the engine then dequantizes an INT8 checkpoint at load
rather than run this, engine/build.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.fp8_linear_reference import check_scaled_operands

INT8_MAX = 127.0
# The least scale of a row: a row of zeros gets this instead of 0 (which would give 0/0).
MIN_SCALE = 1.0 / (INT8_MAX * 65536.0)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] as int8 [M, K] with one float32 scale a row, [M]: x ≈ x_q · scale[:, None]."""
    x = x.float()
    scale = (x.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
    x_q = torch.round(x / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x_q, scale


def quantize_weight(weight: Tensor, per_channel: bool = True) -> tuple[Tensor, Tensor]:
    """W [N, K] as int8 and its float32 scales: [N] per output row, or [1] for the tensor."""
    if per_channel:
        return quantize_rows(weight)
    weight = weight.float()
    scale = (weight.abs().amax() / INT8_MAX).clamp(min=MIN_SCALE).reshape(1)
    return torch.round(weight / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


# Whether torch's int8 GEMM sums exactly on this CPU (None: not checked yet). A module
# global rather than functools.cache: compiled steps call `integer_products`, and dynamo
# traces through a cached function with a warning.
_EXACT: bool | None = None


def int8_gemm_exact() -> bool:
    """Whether `torch._int_mm` gives the exact int32 sums on this CPU: checked once, on the
    sums its 16-bit pair additions would saturate (largest activations against the most
    negative weights) and on random bytes."""
    global _EXACT
    if _EXACT is None:
        x = torch.full((4, 576), 127, dtype=torch.int8)
        w = torch.full((16, 576), -128, dtype=torch.int8)
        extreme = bool((torch._int_mm(x, w.t()) == 127 * -128 * 576).all())
        generator = torch.Generator().manual_seed(0)
        x = torch.randint(-127, 128, (8, 320), dtype=torch.int8, generator=generator)
        w = torch.randint(-128, 128, (24, 320), dtype=torch.int8, generator=generator)
        exact = torch.equal(torch._int_mm(x, w.t()).double(), x.double() @ w.double().t())
        _EXACT = extreme and exact
    return _EXACT


def integer_products(x_q: Tensor, weight: Tensor) -> Tensor:
    """x_q [M, K] int8 @ weight [N, K] int8ᵀ as exact int32 sums [M, N]."""
    if x_q.device.type != "cpu" or int8_gemm_exact():
        return torch._int_mm(x_q, weight.t())
    return (x_q.double() @ weight.double().t()).to(torch.int32)


def check_int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError when x, the int8 weight, its scales and the bias do not fit together."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    check_scaled_operands(x, weight, scale, bias)


def int8_linear_reference(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) with W = weight · scale in int8 and x quantized per row to
    int8, the integer sums exact (`integer_products`), scaled in float32, cast to x's dtype."""
    check_int8_linear(x, weight, scale, bias)
    x_q, x_scale = quantize_rows(x)
    out = integer_products(x_q, weight).float() * x_scale[:, None] * scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
