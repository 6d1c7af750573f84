"""Writing the new tokens' keys and values into the paged KV cache.

The cache is a pool of fixed-size blocks: key_cache/value_cache
[num_blocks, block_size, num_kv_heads, head_size], whatever order their memory is stored in
(`empty_kv_cache`): slot-major, in that order, on a GPU, where the Triton kernels index it
by strides with each head's head_size values contiguous; on the CPU as the torch path reads
it best (`torch_path_layouts`). The runner gives each new token a slot, `block_id * block_size + offset`, in `slot_mapping`; slot -1 marks a padding token whose
key and value are not written. The write happens in place, cast to the cache's dtype,
through the logical indices, so it serves every layout.

An fp8 cache (`--kv-cache-dtype fp8`: float8_e4m3fn, float8_e4m3fnuz on ROCm's gfx94x, or
float8_e5m2) stores key / k_scale and value / v_scale, saturated to the format's largest
finite value (a NaN or inf in the cache would poison every score that reads it); the
attention multiplies them back (attention.py, attention_reference.py). The scales are
1-element float32 tensors, one pair per layer.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import cpu_flags, launch_entry

# Per platform: heads of one token a program copies, and its warps.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"heads_per_program": 8, "num_warps": 4},
    "rocm": {"heads_per_program": 8, "num_warps": 4},
    "cpu": {"heads_per_program": 16, "num_warps": 1},
}

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


KVLayout = Literal["slot_major", "head_major", "dim_major"]
# How memory is ordered behind the logical [num_blocks, block_size, Hkv, D] of each layout.
_STORED_ORDER: dict[str, tuple[int, int, int, int]] = {
    "slot_major": (0, 1, 2, 3),  # [num_blocks, block_size, Hkv, D]
    "head_major": (0, 2, 1, 3),  # [num_blocks, Hkv, block_size, D]: vLLM-CPU's
    "dim_major": (0, 2, 3, 1),  # [num_blocks, Hkv, D, block_size]
}


def torch_path_layouts(dtype: torch.dtype) -> tuple[KVLayout, KVLayout]:
    """The (keys, values) layouts of a pool of `dtype` that the torch path reads best.

    Where decodes weigh the pool in place (`decodes_weigh_in_place`, decode_in_pool.py), a
    dim-major key block holds each head-size component's slots as one run, so that a
    query's scores are weighted sums of those runs, and a head-major value's D components
    are one run. Elsewhere decodes gather a kv head's slots of a block, one run of a
    head-major pool.
    """
    if decodes_weigh_in_place(dtype):
        return ("dim_major", "head_major")
    return ("head_major", "head_major")


def decodes_weigh_in_place(dtype: torch.dtype) -> bool:
    """Whether a CPU pool of `dtype`, under compute in `dtype`, is weighed where it lies
    by its decodes (decode_in_pool.py) rather than gathered: bfloat16 always; float32 on
    a CPU without AVX-512, where MKL's float32 products keep their speed once fbgemm's
    `embedding_bag` has run (on an AVX-512 EPYC they ran 2.6× slower for the rest of the
    process, so float32 gathers there: decode_in_pool.py)."""
    if dtype == torch.bfloat16:
        return True
    return dtype == torch.float32 and not _has_avx512()


@functools.cache
def _has_avx512() -> bool:
    return "avx512f" in cpu_flags()


def empty_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: KVLayout = "slot_major",
) -> Tensor:
    """An uninitialised cache of shape [num_blocks, block_size, Hkv, D], its memory ordered
    as `layout` says (_STORED_ORDER), shown through a permuted view."""
    logical = (num_blocks, block_size, num_kv_heads, head_size)
    order = _STORED_ORDER[layout]
    stored = torch.empty([logical[d] for d in order], dtype=dtype, device=device)
    return stored.permute([order.index(d) for d in range(4)])


def stored_order(cache: Tensor) -> list[int]:
    """The cache's dimensions, outermost in memory first: `cache.permute(stored_order(cache))`
    is contiguous for every layout of empty_kv_cache."""
    return sorted(range(cache.dim()), key=lambda dim: -cache.stride(dim))


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of `dtype` holds scaled fp8 values."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """x / scale in the fp8 `dtype`, saturated to its finite range (the torch path)."""
    finite = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-finite, finite).to(dtype)


def check_kv_scales(cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> bool:
    """Whether the cache is fp8 (then both scales are needed)."""
    if not is_fp8(cache.dtype):
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its k_scale and v_scale")
    return True


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_key_cache_block,
    stride_key_cache_slot,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_slot,
    stride_value_cache_head,
    k_scale_ptr,
    v_scale_ptr,
    num_heads,
    head_size,
    block_size,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per (token, group of BLOCK_HEADS heads).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (dims < head_size)[None, :]

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    key_dst = (
        key_cache_ptr
        + block * stride_key_cache_block
        + offset * stride_key_cache_slot
        + heads[:, None] * stride_key_cache_head
        + dims[None, :]
    )
    value_dst = (
        value_cache_ptr
        + block * stride_value_cache_block
        + offset * stride_value_cache_slot
        + heads[:, None] * stride_value_cache_head
        + dims[None, :]
    )
    tl.store(key_dst, as_stored(key, key_cache_ptr, k_scale_ptr, FP8_MAX), mask=mask)
    tl.store(value_dst, as_stored(value, value_cache_ptr, v_scale_ptr, FP8_MAX), mask=mask)


@triton.jit
def as_stored(values, cache_ptr, scale_ptr, FP8_MAX: tl.constexpr):
    """`values` in the cache's dtype: an fp8 cache's (FP8_MAX > 0) divided by the layer's
    scale and saturated. Shared with kernels/rotary_kv_write.py."""
    if FP8_MAX > 0:
        values = values.to(tl.float32) / tl.load(scale_ptr)
        values = tl.minimum(tl.maximum(values, -FP8_MAX), FP8_MAX)
    return values.to(cache_ptr.dtype.element_ty)


def write_kv_cache_triton(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """The Triton path of `write_kv_cache`."""
    fp8 = check_kv_scales(key_cache, k_scale, v_scale)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache must have unit stride along head_size")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    config = launch_entry(_CONFIG)
    block_heads = min(triton.next_power_of_2(num_heads), config["heads_per_program"])
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _write_kv_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        k_scale if fp8 else slot_mapping,  # never read unless fp8
        v_scale if fp8 else slot_mapping,
        num_heads,
        head_size,
        key_cache.shape[1],
        BLOCK_HEADS=block_heads,
        BLOCK_D=triton.next_power_of_2(head_size),
        FP8_MAX=torch.finfo(key_cache.dtype).max if fp8 else 0.0,
        num_warps=config["num_warps"],
    )


def write_kv_cache_reference(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    skips_tokens: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    slot_index: tuple[Tensor, Tensor] | None = None,
) -> None:
    """The torch path of `write_kv_cache`."""
    if slot_index is None:
        slot_index = slot_blocks_and_offsets(slot_mapping, key_cache.shape[1])
    blocks, offsets = slot_index
    if skips_tokens and bool((slot_mapping < 0).any()):
        tokens = (slot_mapping >= 0).nonzero().squeeze(1)
        key, value, blocks, offsets = key[tokens], value[tokens], blocks[tokens], offsets[tokens]
    if check_kv_scales(key_cache, k_scale, v_scale):
        # torch has no index_put_ for fp8 on the CPU: the bytes are copied as uint8.
        key = quantize_kv(key, k_scale, key_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, v_scale, value_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    # Through the cache's logical [num_blocks, block_size, ...] indices, whatever its
    # layout (empty_kv_cache): one index_put_ each.
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_cache.index_put_((blocks, offsets), key)
    value_cache.index_put_((blocks, offsets), value)


def slot_blocks_and_offsets(
    slot_mapping: Tensor | np.ndarray, block_size: int
) -> tuple[Tensor, Tensor] | tuple[np.ndarray, np.ndarray]:
    """Each slot's (block, offset in it): the cache indices the torch path writes (tensors
    or host arrays, as the slots come)."""
    return slot_mapping // block_size, slot_mapping % block_size


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    skips_tokens: bool = True,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    slot_index: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Write key/value [T, Hkv, D] into the cache slots of `slot_mapping` [T] (in place).

    Slot s is (block s // block_size, offset s % block_size); tokens with slot -1 are
    skipped. A caller that knows no slot is -1 says so with skips_tokens=False, sparing
    the torch path a check in every layer; one that writes every layer of a step gives
    the torch path `slot_index` (slot_blocks_and_offsets) worked out once. An fp8 cache
    needs k_scale and v_scale.
    """
    if dispatch.use_triton():
        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_reference(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            skips_tokens,
            k_scale,
            v_scale,
            slot_index,
        )
