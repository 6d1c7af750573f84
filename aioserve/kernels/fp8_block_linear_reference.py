"""Block-wise FP8 W8A8 linear layers (DeepSeek-V3's and Qwen3's "fine-grained" FP8): the
format, the quantizers and the torch reference.

A block-wise FP8 layer holds its weight W [N, K] as 8-bit floats W_q with one float32
scale a block of `block_rows` × `group` weights, `scale` [⌈N / block_rows⌉, ⌈K / group⌉]:

    W[n, k] ≈ W_q[n, k] · scale[n // block_rows, k // group]

(checkpoints store 128 × 128 blocks; a stacked q/k/v layer whose shards do not start on a
block boundary holds one scale row a weight row, block_rows = 1: models/w8a8_layers.py).
Its input is quantized as it comes, one scale a row and group of `group` columns
("per-token-group", as vLLM's block FP8 layers do): s_x[m, g] = max |x[m, g·group ..]| /
FP8_MAX, so that each group of the product has a scale on both sides:

    y[m, n] = Σ_g s_x[m, g] · scale[n // block_rows, g] · Σ_{k in g} x_q[m, k] · W_q[n, k]

The sums of 8-bit products are exact in float32, so the result only depends on the order
of the sums. `fp8_block_linear_reference` is the oracle of the Triton kernels
(fp8_block_linear.py); on the CPU the model computes on the weights dequantized at load, as
it does for the per-row and per-tensor formats (fp8_linear_reference.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.fp8_linear_reference import MIN_SCALE, check_fp8_dtype


def scale_shape(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scales' shape for a weight [N, K] in blocks of `block` (rows, columns)."""
    return -(-n // block[0]), -(-k // block[1])


def expand_scales(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """The block scales [⌈N / rows⌉, ⌈K / columns⌉] spread over the [N, K] weights they scale."""
    rows, columns = block
    return scale.float().repeat_interleave(rows, 0)[:n].repeat_interleave(columns, 1)[:, :k]


def dequantize_blocks(weight: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """Float32 W [N, K] from fp8 W_q [N, K] and its block scales."""
    n, k = weight.shape
    return weight.float() * expand_scales(scale, block, n, k)


def quantize_groups(x: Tensor, group: int, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [M, K] as `fp8_dtype` with one float32 scale a row and group of `group` columns,
    [M, ⌈K / group⌉]: x ≈ x_q · the scale of its group (the last group may be short)."""
    fp8_max = check_fp8_dtype(fp8_dtype)
    m, k = x.shape
    groups = -(-k // group)
    x = x.float()
    padded = torch.nn.functional.pad(x, (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=2) / fp8_max).clamp(min=MIN_SCALE)
    # The clamp catches the last bit of the division's rounding: past the largest finite
    # value, torch's cast to e4m3fn gives NaN.
    scaled = x / scale.repeat_interleave(group, 1)[:, :k]
    return scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


def quantize_weight_blocks(
    weight: Tensor, block: tuple[int, int], fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """W [N, K] as `fp8_dtype` and its float32 block scales, each block's largest magnitude
    mapped onto the format's largest (as DeepSeek's and Qwen's quantizers do)."""
    fp8_max = check_fp8_dtype(fp8_dtype)
    n, k = weight.shape
    rows, columns = scale_shape(n, k, block)
    padded = torch.nn.functional.pad(
        weight.float(), (0, columns * block[1] - k, 0, rows * block[0] - n)
    )
    blocks = padded.view(rows, block[0], columns, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp(min=MIN_SCALE)
    scaled = weight.float() / expand_scales(scale, block, n, k)
    return scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype), scale


def check_fp8_block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None
) -> None:
    """Raise ValueError when x [M, K], the fp8 weight [N, K], its block scales, the block and
    the bias [N] do not fit together."""
    check_fp8_dtype(weight.dtype)
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"x must be [M, {k}] for a weight of {tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"a block is (rows, columns), both positive; got {block}")
    expected = scale_shape(n, k, block)
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(
            f"block scales must be float32 {list(expected)} for a weight of "
            f"{tuple(weight.shape)} in blocks of {tuple(block)}, got {scale.dtype} "
            f"{list(scale.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def fp8_block_linear_reference(
    x: Tensor, weight: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) with W the block-scaled 8-bit weight and x quantized per row
    and group of block[1] columns to the same format, in float32, cast to x's dtype."""
    check_fp8_block_linear(x, weight, scale, block, bias)
    x_q, x_scale = quantize_groups(x, block[1], weight.dtype)
    x_dequantized = x_q.float() * x_scale.repeat_interleave(block[1], 1)[:, : x.shape[1]]
    out = x_dequantized @ dequantize_blocks(weight, scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
