"""The dequantization of GGUF blocks in registers, for the Triton kernels of gguf_linear.py.

Every supported type is read as groups of 32 weights of a row (a block of the 32-weight
types, a sub-block of a k-quant super-block), two weights at a time: weight j and j + 16 of
the group (j = 0..15), the pair a Q4_0 nibble byte holds. `dequantize_pair` returns them as
(q - offset) * scale + zero in float32, the form of gguf_linear_reference.py's
`unpack_codes` (whose docstring gives the layouts); the kernels multiply the first with
x's column 32 g + j and the second with 32 g + j + 16, so no tile is shuffled into K's order.
"""

from __future__ import annotations

from aioserve.kernels.triton_compat import tl, triton


@triton.jit
def _f16_at(at, mask):
    """The fp16 at byte pointers `at` (even addresses) as float32; 0 where masked."""
    return tl.load(at.to(tl.pointer_type(tl.float16), bitcast=True), mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def _code_float(q, offset):
    """q - offset as float32, q an int32 code: the float 2**23 + q holds q in its low
    mantissa bits, an OR and a subtraction where an int-to-float conversion runs at a
    quarter rate on NVIDIA."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _bytes_at(at, byte, mask, BYTE_AXIS: tl.constexpr):
    """The bytes at `at` (2-D) + `byte` (16 along BYTE_AXIS) as int32; 0 where masked."""
    where = tl.expand_dims(at, BYTE_AXIS) + byte
    return tl.load(where, mask=tl.expand_dims(mask, BYTE_AXIS), other=0).to(tl.int32)


@triton.jit
def _k_scale_min(block_at, sub, mask):
    """The 6-bit scale and min of sub-block `sub` (0..7) of Q4_K/Q5_K blocks at `block_at`,
    ggml's get_scale_min_k4 on the 12 bytes at byte 4."""
    at = block_at + 4
    a = tl.load(at + sub, mask=mask, other=0).to(tl.int32)  # byte s
    b = tl.load(at + sub + 4, mask=mask, other=0).to(tl.int32)  # byte s + 4
    c = tl.load(at + sub % 4, mask=mask, other=0).to(tl.int32)  # byte s - 4 for s >= 4
    first = sub < 4
    scale = tl.where(first, a & 63, (b & 15) | ((c >> 6) << 4))
    minimum = tl.where(first, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def dequantize_pair(
    row_at,
    groups,
    mask,
    byte,
    BYTE_AXIS: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Weights 32 g + j and 32 g + j + 16, float32, of the rows of `QTYPE` blocks of
    BLOCK_BYTES bytes that start at `row_at`, g in `groups` (the two broadcast to `mask`'s
    2-D shape), j in `byte` (0..15 along BYTE_AXIS of a 3-D tile, 1 along the others); the
    byte axis is inserted at BYTE_AXIS. Masked weights are 0."""
    if QTYPE == "q4_k" or QTYPE == "q5_k" or QTYPE == "q6_k":
        block_at = row_at + (groups // 8) * BLOCK_BYTES
        sub = groups % 8
    else:
        block_at = row_at + groups * BLOCK_BYTES
    if QTYPE == "q8_0":
        low = _bytes_at(block_at + 2, byte, mask, BYTE_AXIS) ^ 0x80
        high = _bytes_at(block_at + 18, byte, mask, BYTE_AXIS) ^ 0x80
        scale_low = _f16_at(block_at, mask)
        scale_high = scale_low
        offset = 128.0
    elif QTYPE == "q4_k" or QTYPE == "q5_k":
        sub_scale, sub_min = _k_scale_min(block_at, sub, mask)
        scale_low = _f16_at(block_at, mask) * sub_scale
        scale_high = scale_low
        zero = -(_f16_at(block_at + 2, mask) * sub_min)
        offset = 0.0
        # run s // 2 of 32 nibble bytes: sub-block s in its low (s even) or high nibbles
        run_at = block_at + (BLOCK_BYTES - 128) + (sub // 2) * 32
        shift = tl.expand_dims((sub % 2) * 4, BYTE_AXIS)
        low = (_bytes_at(run_at, byte, mask, BYTE_AXIS) >> shift) & 0xF
        high = (_bytes_at(run_at + 16, byte, mask, BYTE_AXIS) >> shift) & 0xF
        if QTYPE == "q5_k":
            # bit s of qh byte l (32 bytes at 16) is weight l of sub-block s's fifth bit
            bit = tl.expand_dims(sub, BYTE_AXIS)
            low |= ((_bytes_at(block_at + 16, byte, mask, BYTE_AXIS) >> bit) & 1) << 4
            high |= ((_bytes_at(block_at + 32, byte, mask, BYTE_AXIS) >> bit) & 1) << 4
    elif QTYPE == "q6_k":
        half = sub // 4
        part = sub % 4
        # ql: 64 bytes a half, part t in the low (t < 2) or high nibbles of its (t % 2)'th
        # 32 bytes; qh: 32 bytes a half, part t in bits 2t and 2t + 1
        ql_at = block_at + half * 64 + (part % 2) * 32
        qh_at = block_at + 128 + half * 32
        ql_shift = tl.expand_dims((part // 2) * 4, BYTE_AXIS)
        qh_shift = tl.expand_dims(part * 2, BYTE_AXIS)
        low = (_bytes_at(ql_at, byte, mask, BYTE_AXIS) >> ql_shift) & 0xF
        high = (_bytes_at(ql_at + 16, byte, mask, BYTE_AXIS) >> ql_shift) & 0xF
        low |= ((_bytes_at(qh_at, byte, mask, BYTE_AXIS) >> qh_shift) & 3) << 4
        high |= ((_bytes_at(qh_at + 16, byte, mask, BYTE_AXIS) >> qh_shift) & 3) << 4
        # an int8 scale per 16 weights: weight j of the group takes scale 2s, j + 16 2s + 1
        d = _f16_at(block_at + 208, mask)
        scales_at = (block_at + 192 + sub * 2).to(tl.pointer_type(tl.int8), bitcast=True)
        scale_low = d * tl.load(scales_at, mask=mask, other=0).to(tl.float32)
        scale_high = d * tl.load(scales_at + 1, mask=mask, other=0).to(tl.float32)
        offset = 32.0
    else:
        tl.static_assert(
            QTYPE == "q4_0" or QTYPE == "q4_1" or QTYPE == "q5_0" or QTYPE == "q5_1",
            "not a supported GGUF type",
        )
        packed = _bytes_at(block_at + (BLOCK_BYTES - 16), byte, mask, BYTE_AXIS)  # the last 16
        low = packed & 0xF
        high = packed >> 4
        if QTYPE == "q5_0" or QTYPE == "q5_1":
            # bit i of the little-endian 32 bits qh is weight i's fifth: two 16-bit halves
            halves_at = (block_at + (4 if QTYPE == "q5_1" else 2)).to(
                tl.pointer_type(tl.uint16), bitcast=True
            )
            qh_low = tl.expand_dims(tl.load(halves_at, mask=mask, other=0).to(tl.int32), BYTE_AXIS)
            qh_high = tl.expand_dims(
                tl.load(halves_at + 1, mask=mask, other=0).to(tl.int32), BYTE_AXIS
            )
            low |= ((qh_low >> byte) & 1) << 4
            high |= ((qh_high >> byte) & 1) << 4
        scale_low = _f16_at(block_at, mask)
        scale_high = scale_low
        if QTYPE == "q4_1" or QTYPE == "q5_1":
            zero = _f16_at(block_at + 2, mask)
        offset = 8.0 if QTYPE == "q4_0" else 16.0 if QTYPE == "q5_0" else 0.0
    low = _code_float(low, offset) * tl.expand_dims(scale_low, BYTE_AXIS)
    high = _code_float(high, offset) * tl.expand_dims(scale_high, BYTE_AXIS)
    if QTYPE == "q4_1" or QTYPE == "q5_1" or QTYPE == "q4_k" or QTYPE == "q5_k":
        zero = tl.expand_dims(zero, BYTE_AXIS)
        low += zero
        high += zero
    return low, high
