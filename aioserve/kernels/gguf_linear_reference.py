"""GGUF's quantized weights multiplied as they are stored: the torch reference, and the CPU
path of the 4-bit types.

The layouts follow ggml's ggml-common.h. A row of a weight is a run of blocks, each holding
32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or a super-block of 256 (Q4_K, Q5_K, Q6_K);
fp16 fields are little-endian:

- Q4_0 (18 bytes): d, 16 bytes of nibbles (byte j: weight j low, weight j + 16 high);
  w = d (q - 8).
- Q4_1 (20): d, m, the nibbles; w = d q + m.
- Q5_0 (22): d, 4 bytes qh (bit j the fifth bit of weight j), the nibbles; w = d (q - 16).
- Q5_1 (24): d, m, qh, the nibbles; w = d q + m.
- Q8_0 (34): d, 32 int8 codes; w = d q.
- Q4_K (144): d, dmin, 12 bytes of eight 6-bit scales and mins (`_k_scales`), 128 bytes
  of nibbles in four runs of 32: run c's low nibbles are the 32 weights of sub-block 2c,
  its high ones those of 2c + 1; w = (d sc_s) q - dmin m_s.
- Q5_K (176): as Q4_K, with 32 bytes qh before the nibbles: bit s of byte l is the fifth
  bit of weight l of sub-block s.
- Q6_K (210): 128 bytes ql, 64 bytes qh, 16 int8 scales, d. Each half h (128 weights) has
  ql[64h : 64h + 64] and qh[32h : 32h + 32]; weight 32t + l of the half (t = 0..3) takes
  the low (t < 2) or high nibble of ql byte 64h + 32 (t % 2) + l and bits 2t, 2t + 1 of
  qh byte 32h + l as its top two bits; w = (d sc_g) (q - 32), a scale per 16 weights.

`unpack_codes` reads every type into one form, the one the Triton kernels compute
(kernels/gguf_dequant.py): codes q (uint8, one a weight), a scale and a zero per group of
`SCALE_GROUP` weights, and the type's `CODE_OFFSET`, w = (q - offset) * scale + zero (a Q8_0
int8 code c is read as q = c + 128). In float32 every step of that is the one gguf-py's
`gguf.quants.dequantize` takes, so the weights are its, bit for bit.
`gguf_linear_reference` is the plain float32 product of those weights, the oracle of the
Triton kernels and `gguf_linear`'s CPU path (a model on a CPU keeps no blocks but the 4-bit
ones below: its other layers multiply the weights the loader dequantized).

The CPU path of Q4_0 and Q4_1 (`pack_int4`, `int4_linear`) lays the codes out once for
torch's weight-only int4 matmul (`aten._weight_int4pack_mm_for_cpu`, groups of 32 along the
input, a scale and zero per group), which reads 4.5 bits a weight where bfloat16 reads 16.
On a Xeon with AMX the 120 products of a SmolLM2 step took 3.8–7.3 ms at one row against
13–19 ms for oneDNN on packed bfloat16 weights, about the same at eight rows and 4× longer
at 64 (`python bench/packed_products.py`), so it serves small steps only. The op takes the
scale and zero in the activations' dtype; in bfloat16 they are rounded to it (an error of at
most 2⁻⁹ of each, well under the 4-bit step d), and with float32 activations it is ~15×
slower.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZE = 32  # weights per block of the 32-weight types, per sub-block of the k-quants
SUPER_BLOCK = 256  # weights per k-quant super-block
INT4_ROW_MULTIPLE = 16  # torch's int4 CPU layout packs the output rows in sixteens
# (weights, bytes) of a block of each type
BLOCK_LAYOUT = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
GGUF_TYPES = tuple(BLOCK_LAYOUT)
FOUR_BIT_TYPES = ("q4_0", "q4_1")  # the types of torch's int4 CPU op
CODE_OFFSET = {"q4_0": 8, "q5_0": 16, "q8_0": 128, "q6_k": 32}  # 0 for the others
SCALE_GROUP = {"q6_k": 16}  # weights per scale and zero; 32 for the others


def _f16(blocks: Tensor, start: int) -> Tensor:
    """The fp16 at byte `start` of each block (n, bytes) as float32 (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: Tensor) -> Tensor:
    """Bytes (..., b) as (..., 2b) 4-bit values: every low nibble, then every high one."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: Tensor, count: int) -> Tensor:
    """(..., count) bits of each byte of (..., b) as (..., count, b), bit 0 first."""
    shifts = torch.arange(count, dtype=torch.uint8, device=packed.device).view(count, 1)
    return (packed.unsqueeze(-2) >> shifts) & 1


def _k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K blocks (n, 12): sub-blocks 0–3 in the
    low six bits of bytes 0–3 (scales) and 4–7 (mins); 4–7 in the nibbles of bytes 8–11,
    their top two bits in the top bits of bytes 0–3 (scales) and 4–7 (mins)."""
    low, mid, high = packed.reshape(-1, 3, 4).unbind(1)
    scales = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _unpack_flat(flat: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """(codes (n, weights), scale and zero (n, groups)) of blocks (n, bytes) of `qtype`."""
    n = flat.shape[0]
    if qtype in ("q4_0", "q4_1", "q5_0", "q5_1"):
        has_min = qtype.endswith("_1")
        codes = _nibbles(flat[:, -16:])
        if qtype.startswith("q5"):
            qh_at = 4 if has_min else 2
            qh = flat[:, qh_at : qh_at + 4]
            codes = codes | (_bits(qh, 8).transpose(1, 2).reshape(n, 32) << 4)
        zero = _f16(flat, 2) if has_min else flat.new_zeros(n, 1, dtype=torch.float32)
        return codes, _f16(flat, 0), zero
    if qtype == "q8_0":
        return flat[:, 2:] ^ 0x80, _f16(flat, 0), flat.new_zeros(n, 1, dtype=torch.float32)
    if qtype in ("q4_k", "q5_k"):
        sc, m = _k_scales(flat[:, 4:16])
        codes = _nibbles(flat[:, -128:].reshape(n, 4, 32)).reshape(n, 8, 32)
        if qtype == "q5_k":
            codes = codes | (_bits(flat[:, 16:48], 8) << 4)
        return codes.reshape(n, 256), _f16(flat, 0) * sc, -(_f16(flat, 2) * m)
    if qtype == "q6_k":
        low = _nibbles(flat[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=flat.device).view(1, 1, 4, 1)
        high = (flat[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
        codes = (low | (high << 4)).reshape(n, 256)
        scale = _f16(flat, 208) * flat[:, 192:208].view(torch.int8).float()
        return codes, scale, torch.zeros_like(scale)
    raise ValueError(f"not a supported GGUF type: {qtype!r}; expected one of {GGUF_TYPES}")


def unpack_codes(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """Codes uint8 [N, K], scale and zero float32 [N, K / SCALE_GROUP] of a weight stored as
    GGUF `qtype` blocks, uint8 [N, K / block weights * block bytes]:
    w = (q - CODE_OFFSET) * scale + zero."""
    if qtype not in BLOCK_LAYOUT:
        raise ValueError(f"not a supported GGUF type: {qtype!r}; expected one of {GGUF_TYPES}")
    rows = blocks.shape[0]
    codes, scale, zero = _unpack_flat(blocks.reshape(-1, BLOCK_LAYOUT[qtype][1]), qtype)
    return codes.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def dequantize_blocks(blocks: Tensor, qtype: str) -> Tensor:
    """Float32 weights [N, K] of GGUF `qtype` blocks, in `unpack_codes`' form."""
    codes, scale, zero = unpack_codes(blocks, qtype)
    values = codes.float() - CODE_OFFSET.get(qtype, 0)
    group = SCALE_GROUP.get(qtype, GROUP_SIZE)
    values = values.reshape(codes.shape[0], -1, group) * scale.unsqueeze(-1)
    return (values + zero.unsqueeze(-1)).reshape(codes.shape)


def unpack_blocks(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """Codes uint8 [N, K] (0..15), scale and zero float32 [N, K / 32] of a Q4_0 or Q4_1
    weight in torch's int4 form: w = (q - 8) * scale + zero."""
    if qtype not in FOUR_BIT_TYPES:
        raise ValueError(f"not a 4-bit GGUF type: {qtype!r}; expected one of {FOUR_BIT_TYPES}")
    codes, scale, zero = unpack_codes(blocks, qtype)
    if qtype == "q4_1":
        zero = zero + 8 * scale
    return codes, scale, zero


def dequantize_codes(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Float32 weights [N, K] from `unpack_blocks`' codes, scale and zero."""
    values = codes.float().reshape(codes.shape[0], -1, GROUP_SIZE) - 8
    weights = values * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return weights.reshape(codes.shape)


def gguf_linear_reference(
    x: Tensor, blocks: Tensor, qtype: str, bias: Tensor | None = None
) -> Tensor:
    """x [M, K] @ wᵀ (+ bias) with w the GGUF blocks' weights, in float32, cast to x's dtype."""
    weight = dequantize_blocks(blocks, qtype)
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
    # torch's own binding: through torch.ops, ~1 us more a call, 120 calls a step.
    out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP_SIZE, scales_and_zeros)
    return out if bias is None else out + bias
