"""GGUF's 4-bit weights (Q4_0, Q4_1) multiplied as they are stored: the torch reference and
the CPU path.

A Q4_0 or Q4_1 block holds 32 consecutive weights of one row: an fp16 scale d (Q4_1: then
an fp16 minimum m), then 16 bytes, byte j holding weight j in its low nibble and weight
j + 16 in its high one. A weight is d * (q - 8) (Q4_0) or d * q + m (Q4_1): both are
(q - 8) * scale + zero, with zero 0 or m + 8d. `unpack_blocks` reads that form, the one the
kernels work in; `gguf_linear_reference` is the plain float32 product of the dequantized
weights, the oracle of the Triton kernel and of the CPU path.

The CPU path (`pack_int4`, `int4_linear`) lays the codes out once for torch's weight-only
int4 matmul (`aten._weight_int4pack_mm_for_cpu`, groups of 32 along the input, a scale and
zero per group), which reads 4.5 bits a weight where bfloat16 reads 16. On a Xeon with AMX
the 120 products of a SmolLM2 step took 3.8–7.3 ms at one row against 13–19 ms for oneDNN
on packed bfloat16 weights, about the same at eight rows and 4× longer at 64
(`python bench/packed_products.py`), so it serves small steps only. The op takes the scale
and zero in the activations' dtype; in bfloat16 they are rounded to it (an error of at most
2⁻⁹ of each, well under the 4-bit step d), and with float32 activations it is ~15× slower.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZE = 32
INT4_ROW_MULTIPLE = 16  # torch's int4 CPU layout packs the output rows in sixteens
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20}
FOUR_BIT_TYPES = tuple(BLOCK_BYTES)


def _f16_column(blocks: Tensor, start: int) -> Tensor:
    """The fp16 at byte `start` of each block (n, bytes) as float32 (n,)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float().squeeze(1)


def unpack_blocks(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """Codes uint8 [N, K] (0..15), scale and zero float32 [N, K / 32] of a 4-bit weight
    stored as GGUF blocks, uint8 [N, K / 32 * block bytes]: w = (q - 8) * scale + zero."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"not a 4-bit GGUF type: {qtype!r}; expected one of {FOUR_BIT_TYPES}")
    rows = blocks.shape[0]
    block_bytes = BLOCK_BYTES[qtype]
    flat = blocks.reshape(-1, block_bytes)
    scale = _f16_column(flat, 0)
    if qtype == "q4_0":
        zero = torch.zeros_like(scale)
    else:
        zero = _f16_column(flat, 2) + 8 * scale
    nibbles = flat[:, block_bytes - 16 :]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)
    return codes.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def dequantize_codes(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Float32 weights [N, K] from `unpack_blocks`' codes, scale and zero."""
    values = codes.float().reshape(codes.shape[0], -1, GROUP_SIZE) - 8
    weights = values * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return weights.reshape(codes.shape)


def gguf_linear_reference(
    x: Tensor, blocks: Tensor, qtype: str, bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ wᵀ (+ bias) with w the GGUF blocks' weights, in float32, cast to x's dtype."""
    weight = dequantize_codes(*unpack_blocks(blocks, qtype))
    out = x.float() @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fits_int4(out_features: int, in_features: int) -> bool:
    """Whether `pack_int4` can lay out a weight of this shape."""
    return out_features % INT4_ROW_MULTIPLE == 0 and in_features % GROUP_SIZE == 0


def pack_int4(
    codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[Tensor, Tensor]:
    """The packed codes and [K / 32, N, 2] scales and zeros `int4_linear` takes, laid out
    once at load for torch's int4 CPU matmul; `dtype` is the activations'."""
    if not fits_int4(*codes.shape):
        raise ValueError(
            f"a weight of {codes.shape[0]} rows of {codes.shape[1]} does not fit torch's int4 "
            f"layout: rows a multiple of {INT4_ROW_MULTIPLE}, inputs of {GROUP_SIZE}"
        )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    return packed, scales_and_zeros


def int4_linear(
    x: Tensor, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ wᵀ (+ bias) on `pack_int4`'s layout, in x's dtype (that of the scales)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), packed, GROUP_SIZE, scales_and_zeros
    )
    return out if bias is None else out + bias
