"""Rotary embedding and the KV-cache write in one launch (issue 14, item 4).

A layer's attention starts with three small launches on a GPU: the queries rotated
(rotary.py), the keys rotated, then keys and values written into their cache slots
(kv_cache.py). At one stream of Llama-3-8B each is a few microseconds of a ~6.5 ms token,
32 layers over. Here one launch does all three: a program rotates a group of query heads,
or rotates a group of key heads, writes them (and their value heads) into the token's slot
and hands the rotated keys back, for a prefill's attention that reads them as they come.

The numbers are those of `apply_rotary` then `write_kv_cache` (the two share their Triton
helpers with this kernel: `rotary.rotary_angles`, `rotary.rotated_pairs`,
`kv_cache.as_stored`), which is the reference: neox and GPT-J pairs, partial rotary, slots
of -1 skipped, fp8 caches scaled and saturated, either cache layout (indexed by strides).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.kv_cache import (
    as_stored,
    check_kv_scales,
    write_kv_cache_reference,
)
from aioserve.kernels.rotary import apply_rotary_reference, rotary_angles, rotated_pairs
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Per platform: heads of one token a program takes, and its warps (as rotary.py's).
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"heads_per_program": 8, "num_warps": 4},
    "rocm": {"heads_per_program": 8, "num_warps": 4},
    "cpu": {"heads_per_program": 4, "num_warps": 1},
}


@triton.jit
def _rotate_heads(
    src, dst, head_mask, cos, sin, first, second, pair_mask, rotary_dim, HEAD_SIZE, BLOCK_PASS
):
    """The heads at `src` [BLOCK_HEADS, 1] rotated into `dst`; returns their rotated pairs
    in dst's dtype (as `apply_rotary` rounds them before a KV write)."""
    mask = head_mask & pair_mask[None, :]
    rotated_first, rotated_second = rotated_pairs(src, cos, sin, first, second, mask)
    rotated_first = rotated_first.to(dst.dtype.element_ty)
    rotated_second = rotated_second.to(dst.dtype.element_ty)
    tl.store(dst + first[None, :], rotated_first, mask=mask)
    tl.store(dst + second[None, :], rotated_second, mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: the dimensions past rotary_dim copied
        passed = rotary_dim + tl.arange(0, BLOCK_PASS)
        pass_mask = head_mask & (passed < HEAD_SIZE)[None, :]
        tl.store(dst + passed[None, :], tl.load(src + passed[None, :], mask=pass_mask), pass_mask)
    return rotated_first, rotated_second


@triton.jit
def _write_slot(
    key_src, key_first, key_second, value_src, key_dst, value_dst, head_mask, first,
    second, pair_mask, rotary_dim, k_scale_ptr, v_scale_ptr, key_cache_ptr, value_cache_ptr,
    HEAD_SIZE, BLOCK_PASS, BLOCK_D, FP8_MAX,
):  # fmt: skip
    """The rotated key heads and their value heads (`*_src` [BLOCK_HEADS, 1]) stored at
    their slot (`*_dst`), as kv_cache.py's kernel stores them."""
    mask = head_mask & pair_mask[None, :]
    tl.store(
        key_dst + first[None, :], as_stored(key_first, key_cache_ptr, k_scale_ptr, FP8_MAX), mask
    )
    tl.store(
        key_dst + second[None, :], as_stored(key_second, key_cache_ptr, k_scale_ptr, FP8_MAX), mask
    )
    if BLOCK_PASS > 0:
        passed = rotary_dim + tl.arange(0, BLOCK_PASS)
        pass_mask = head_mask & (passed < HEAD_SIZE)[None, :]
        rest = tl.load(key_src + passed[None, :], mask=pass_mask)
        tl.store(
            key_dst + passed[None, :],
            as_stored(rest, key_cache_ptr, k_scale_ptr, FP8_MAX),
            pass_mask,
        )
    dims = tl.arange(0, BLOCK_D)
    value_mask = head_mask & (dims < HEAD_SIZE)[None, :]
    value = tl.load(value_src + dims[None, :], mask=value_mask)
    tl.store(
        value_dst + dims[None, :],
        as_stored(value, value_cache_ptr, v_scale_ptr, FP8_MAX),
        value_mask,
    )


@triton.jit
def _rotary_kv_write_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    query_out_ptr,
    key_out_ptr,
    cos_sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_query_token,
    stride_key_token,
    stride_value_token,
    stride_cos_sin,
    stride_key_cache_block,
    stride_key_cache_slot,
    stride_key_cache_head,
    stride_value_cache_block,
    stride_value_cache_slot,
    stride_value_cache_head,
    num_q_heads,
    num_kv_heads,
    rotary_dim,
    block_size,
    HEAD_SIZE: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per (token, group of BLOCK_HEADS query heads or key heads): the query
    # groups first. Heads are HEAD_SIZE apart within a token in the inputs and outputs.
    # (Each branch's work is a function of its own: Triton merges the names both branches
    # assign, and the two would assign them other types.)
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    query_groups = (num_q_heads + BLOCK_HEADS - 1) // BLOCK_HEADS
    cos, sin, first, second, pair_mask = rotary_angles(
        positions_ptr, token, cos_sin_ptr, stride_cos_sin, rotary_dim, IS_NEOX, BLOCK_HALF
    )
    if group < query_groups:
        heads = group * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _rotate_heads(
            query_ptr + token * stride_query_token + heads[:, None] * HEAD_SIZE,
            query_out_ptr + token * num_q_heads * HEAD_SIZE + heads[:, None] * HEAD_SIZE,
            (heads < num_q_heads)[:, None], cos, sin, first, second, pair_mask, rotary_dim,
            HEAD_SIZE, BLOCK_PASS,
        )  # fmt: skip
    else:
        heads = (group - query_groups) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        head_mask = (heads < num_kv_heads)[:, None]
        key_src = key_ptr + token * stride_key_token + heads[:, None] * HEAD_SIZE
        key_first, key_second = _rotate_heads(
            key_src,
            key_out_ptr + token * num_kv_heads * HEAD_SIZE + heads[:, None] * HEAD_SIZE,
            head_mask, cos, sin, first, second, pair_mask, rotary_dim, HEAD_SIZE, BLOCK_PASS,
        )  # fmt: skip
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block = slot // block_size
            offset = slot % block_size
            _write_slot(
                key_src, key_first, key_second,
                value_ptr + token * stride_value_token + heads[:, None] * HEAD_SIZE,
                key_cache_ptr + block * stride_key_cache_block + offset * stride_key_cache_slot
                + heads[:, None] * stride_key_cache_head,
                value_cache_ptr + block * stride_value_cache_block
                + offset * stride_value_cache_slot + heads[:, None] * stride_value_cache_head,
                head_mask, first, second, pair_mask, rotary_dim, k_scale_ptr, v_scale_ptr,
                key_cache_ptr, value_cache_ptr, HEAD_SIZE, BLOCK_PASS, BLOCK_D, FP8_MAX,
            )  # fmt: skip


def _heads_packed(x: Tensor) -> Tensor:
    """x [T, H, D] with each token's heads one run of memory (any token stride)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def rotary_and_write_kv_triton(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos_sin_cache: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    is_neox_style: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The Triton path of `rotary_and_write_kv`: one launch."""
    fp8 = check_kv_scales(key_cache, k_scale, v_scale)
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache must have unit stride along head_size")
    query, key, value = _heads_packed(query), _heads_packed(key), _heads_packed(value)
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    rotary_dim = cos_sin_cache.shape[1]
    config = launch_entry(_CONFIG)
    block_heads = min(
        triton.next_power_of_2(max(num_q_heads, num_kv_heads)), config["heads_per_program"]
    )
    groups = triton.cdiv(num_q_heads, block_heads) + triton.cdiv(num_kv_heads, block_heads)
    _rotary_kv_write_kernel[(num_tokens, groups)](
        positions,
        query,
        key,
        value,
        query_out,
        key_out,
        cos_sin_cache,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # never read unless fp8
        v_scale if fp8 else slot_mapping,
        query.stride(0),
        key.stride(0),
        value.stride(0),
        cos_sin_cache.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        num_q_heads,
        num_kv_heads,
        rotary_dim,
        key_cache.shape[1],
        HEAD_SIZE=head_size,
        IS_NEOX=is_neox_style,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(head_size - rotary_dim) if head_size > rotary_dim else 0,
        BLOCK_D=triton.next_power_of_2(head_size),
        FP8_MAX=torch.finfo(key_cache.dtype).max if fp8 else 0.0,
        num_warps=config["num_warps"],
    )
    return query_out, key_out


def rotary_and_write_kv(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos_sin_cache: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    is_neox_style: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """query [T, Hq, D] and key [T, Hkv, D] rotated by the angles of `positions` [T]
    (returned), and the rotated keys and `value` [T, Hkv, D] written into the cache slots
    of `slot_mapping` [T] (slot -1: not written). `apply_rotary` then `write_kv_cache`."""
    if dispatch.use_triton():
        return rotary_and_write_kv_triton(
            positions, query, key, value, cos_sin_cache, key_cache, value_cache,
            slot_mapping, is_neox_style, k_scale, v_scale,
        )  # fmt: skip
    query, key = apply_rotary_reference(positions, query, key, cos_sin_cache, is_neox_style)
    write_kv_cache_reference(
        key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    return query, key
