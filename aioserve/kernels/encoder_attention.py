"""Bidirectional (non-causal) attention over a packed batch of variable-length sequences,
without a KV cache: the attention of encoder-only models (BERT and its kin).

Sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1] of q, k and v [T, heads, head_dim] and
every one of its rows attends to all of its rows; out[t] = softmax(q[t] kᵀ · scale) v
over the sequence of t. Query heads and key/value heads are one to one.

Triton path: one program per (tile of BLOCK_M query rows of one sequence, head), flash
attention style: the sequence's keys in tiles of BLOCK_N, an online softmax in float32
(base 2), tl.dot for q kᵀ and p v with float32 accumulation. The grid counts tiles over
the whole packed batch; a program finds its sequence by binary search over cu_seqlens
(attention_triton.py's `_find_sequence`: sequence b's tiles are numbered from
cu_seqlens[b] // BLOCK_M + b on). Tiles start at fixed offsets within their sequence,
tile sizes depend only on the device and the head size, and every row reduces its keys
from first to last, so a sequence's output is bitwise the same whatever shares its batch.

Reference path (the CPU's production path): encoder_attention_reference.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.attention_triton import _find_sequence
from aioserve.kernels.encoder_attention_reference import (
    check_encoder_shapes,
    encoder_attention_reference,
)
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Query rows and keys per tile, warps and pipeline stages, for head dims up to 64 and
# (_HEAD128_CONFIG) up to 128. Fixed per device family, never by batch: batch invariance
# depends on it. The GPU rows are the largest tiles tried that compile without a register
# spill and within the family's shared memory at head dims 32, 64 and 128
# (tests/kernels/test_gpu_compile.py): at head dim 64, 64 x 64 tiles on 4 warps spilled on
# sm_80, and at 128, 64 x 64 on 4 warps spilled on sm_90a and sm_80 and 64 x 32 on RDNA3
# (gfx1100). Not yet timed on a GPU. The "cpu" row is the interpreter's (small tiles, fast
# tests). Head dims over 128 are refused: every tile tried at 256 spilled on RDNA3, and no
# encoder model served here has them.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    "rocm": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 1},
    "rdna3": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 1},
    "cpu": {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1},
}
_HEAD128_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
    "rocm": {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 1},
    "rdna3": {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1},
    "cpu": {"block_m": 16, "block_n": 16, "num_warps": 1, "num_stages": 1},
}
# tl.dot needs at least 16 rows, columns and reduction depth on every GPU target.
_MIN_DOT = 16
MAX_HEAD_DIM = 128


def launch_config(head_block: int) -> dict[str, int]:
    """The launch table entry for heads of `head_block` lanes (a power of two) here."""
    return dict(launch_entry(_HEAD128_CONFIG if head_block > 64 else _CONFIG))


@triton.jit
def _encoder_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    qk_scale,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_out_token,
    stride_out_head,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (tile of BLOCK_M query rows of one sequence, head).
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_ptr, num_seqs, tile, BLOCK_M)
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    first_row = (tile - (seq_start // BLOCK_M + seq)) * BLOCK_M
    if first_row >= seq_len:
        return

    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    row_tokens = (seq_start + rows).to(tl.int64)
    mask = (rows < seq_len)[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + row_tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    k_head_ptr = k_ptr + head * stride_k_head
    v_head_ptr = v_ptr + head * stride_v_head

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for key_start in range(0, seq_len, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_mask = keys < seq_len
        key_tokens = (seq_start + keys).to(tl.int64)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_head_ptr + key_tokens[:, None] * stride_k_token + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_head_ptr + key_tokens[:, None] * stride_v_token + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one real key (its first), so row_max is finite from
        # the first tile on and nothing below is NaN.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_max = new_max

    tl.store(
        out_ptr + row_tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def encoder_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """The Triton path of `encoder_attention`."""
    check_encoder_shapes(q, k, v, cu_seqlens)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need unit stride along head_dim")
    num_tokens, num_heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is over the kernel's {MAX_HEAD_DIM}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs == 0 or num_tokens == 0 or max_seqlen == 0:
        return out
    if out.stride(-1) != 1:
        raise ValueError("out needs unit stride along head_dim")

    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    config = launch_config(block_d)
    block_m = config["block_m"]
    # Sequence b's tiles start at cu_seqlens[b] // block_m + b (see _find_sequence), so
    # this many tile numbers cover every sequence.
    num_tiles = num_tokens // block_m + num_seqs
    _encoder_attention_kernel[(num_tiles, num_heads)](
        q,
        k,
        v,
        out,
        cu_seqlens,
        scale * math.log2(math.e),
        num_seqs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        BLOCK_M=block_m,
        BLOCK_N=config["block_n"],
        BLOCK_D=block_d,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out


def encoder_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Bidirectional attention within each sequence of a packed batch.

    q, k, v [T, heads, head_dim] (float16, bfloat16 or float32; strided views of a fused
    projection are fine, unit stride along head_dim); cu_seqlens int32 [B+1], the first
    row of each sequence then T; max_seqlen the longest sequence's length. Returns
    [T, heads, head_dim] in q's dtype, written into `out` when given; rows past
    cu_seqlens[-1] are not written.
    """
    if dispatch.use_triton():
        return encoder_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, out)
    return encoder_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale, out)
