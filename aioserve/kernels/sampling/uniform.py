"""The uniforms of the exponential race: a counter-based hash of (seed, step, token id).

Computed in 32-bit integer arithmetic held in int64, identically by the Triton helpers
and the torch reference, so both paths draw the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.triton_compat import tl, triton

_MASK32 = 0xFFFFFFFF
# The mixer is "lowbias32" (Chris Wellons' hash-prospector), a bijection on 32 bits.
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
