"""Causal prefill attention as batched matrix products: the torch path's bfloat16 prefills.

torch's CPU SDPA (its flash kernel) sets each (query block, head) pair up on its own and
packs the keys again for every query head of a GQA group. At SmolLM2's shapes (9 query
heads over 3 kv heads, head size 64, bfloat16, an AVX-512 EPYC) a 256-token prompt took
1.44 ms a layer through it, padding included, and 0.85 ms as the products below; 2,048
tokens 43.9 against 34.1 ms. Below ~128 rows the products' padding costs more than SDPA
spends, so shorter prefills keep SDPA (`uses_products`), and so does a CPU without
bfloat16 arithmetic (`--dtype bfloat16` on AVX2), where torch's bfloat16 products fall back
to slow code: 24.9 ms a 256-token prompt's layer against SDPA's 1.0 (torch held to AVX2 on
a Zen 5 EPYC, ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2). On a CPU with AMX the
flash kernel multiplies its blocks on the AMX tiles and wins at every prefill shape
(bench/prefill_attention.py on a Xeon with AMX, ms a layer: 16 prompts of 256 tokens 4.4
against the products' 10.0, 32 of 128 2.9 against 11.7, one of 2,048 9.5 against 30.1),
so the products are for AVX-512-BF16 without AMX (`uses_products`).

A sequence's query rows go in chunks of CHUNK_ROWS, each against the keys up to its last
row, so the blocks above the causal diagonal are mostly skipped. A chunk is two products
with a softmax between them (float32 inside): the scores [Hkv, group · rows, keys], the GQA group's
query heads stacked as rows, come out of one `baddbmm` that scales them and adds the
chunk's mask, rounded to bfloat16 (as the decode groups' scores and transformers' eager
attention round them).

oneDNN builds a primitive for every new product shape (~0.7 ms, and aioserve keeps 16 of
them, host_memory.py), so the shapes are few: rows padded to ROW_ALIGN and keys to
KEY_ALIGN. Padded keys are zero and masked; padded rows are dropped.
Through a sliding window a chunk starts reading at its first row's window, rounded down to
KEY_ALIGN, and its bias masks the keys before each row's window. Keys are capped at MAX_KEYS (the float32 scores of a chunk then stay under 40 MB); longer
contexts keep SDPA, whose memory does not grow with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.platform import cpu_fast_bf16_flag

CHUNK_ROWS = 256
ROW_ALIGN = 64
KEY_ALIGN = 256
MIN_ROWS = 128
MAX_KEYS = 4096


@dataclass
class ProductChunk:
    """Query rows start:end of one prefill (counted from its first row) and what they attend."""

    start: int
    end: int
    padded_rows: int  # end - start, rounded up to ROW_ALIGN
    keys: int  # keys the chunk reads: through its last row, rounded up to KEY_ALIGN
    # [group · padded_rows, keys - first_key] bfloat16, added to the scaled scores: 0 where
    # a row attends a key, -inf elsewhere (the same for every query head of the group).
    bias: Tensor
    # The first key read: 0, or through a sliding window the start of its first row's
    # window, rounded down to KEY_ALIGN.
    first_key: int = 0


def padded_key_count(seq_len: int) -> int:
    """How many keys (real, then zero) the products read for a sequence of seq_len."""
    return round_up(seq_len, KEY_ALIGN)


def uses_products(dtype: torch.dtype, query_len: int, seq_len: int) -> bool:
    """Whether a prefill of query_len rows over seq_len keys goes through the products."""
    return (
        dtype == torch.bfloat16
        and query_len >= MIN_ROWS
        and padded_key_count(seq_len) <= MAX_KEYS
        and cpu_fast_bf16_flag() == "avx512_bf16"
    )


def plan_chunks(
    query_len: int, seq_len: int, group_size: int, device: torch.device, window: int = 0
) -> list[ProductChunk]:
    """The chunks of a prefill whose query_len rows are the last of its seq_len positions,
    each row seeing the last `window` positions through its own when that is not 0."""
    context_len = seq_len - query_len
    chunks = []
    for start in range(0, query_len, CHUNK_ROWS):
        end = min(query_len, start + CHUNK_ROWS)
        padded_rows = round_up(end - start, ROW_ALIGN)
        keys = round_up(context_len + end, KEY_ALIGN)
        first_key = 0
        if window:
            first_key = max(0, context_len + start + 1 - window) // KEY_ALIGN * KEY_ALIGN
        positions = context_len + start + torch.arange(padded_rows, device=device)
        key_index = torch.arange(first_key, keys, device=device)
        # Padded rows carry on the positions: never an empty row, and they are dropped.
        attended = (key_index[None, :] <= positions[:, None]) & (key_index[None, :] < seq_len)
        if window:
            attended &= key_index[None, :] > positions[:, None] - window
        bias = torch.zeros((padded_rows, keys - first_key), dtype=torch.bfloat16, device=device)
        bias.masked_fill_(~attended, float("-inf"))
        chunks.append(
            ProductChunk(
                start, end, padded_rows, keys, bias.repeat(group_size, 1), first_key=first_key
            )
        )
    return chunks


def attend_by_products(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    chunks: list[ProductChunk],
    scale: float,
    out: Tensor,
) -> None:
    """query [q_len, Hq, D] over keys and values [Hkv, >= every chunk's keys, D] (zero past
    the sequence), all bfloat16, written into `out` [q_len, Hq, D]."""
    query_len, num_q_heads, head_size = query.shape
    num_kv_heads = keys.shape[0]
    group_size = num_q_heads // num_kv_heads
    # [Hkv, group, q_len, D]: a kv head's query heads are consecutive, as in the model.
    heads = query.view(query_len, num_kv_heads, group_size, head_size).permute(1, 2, 0, 3)
    for chunk in chunks:
        rows = chunk.end - chunk.start
        stacked = heads.new_empty((num_kv_heads, group_size, chunk.padded_rows, head_size))
        stacked[:, :, :rows] = heads[:, :, chunk.start : chunk.end]
        stacked[:, :, rows:] = 0
        stacked = stacked.view(num_kv_heads, group_size * chunk.padded_rows, head_size)
        read = slice(chunk.first_key, chunk.keys)
        scores = torch.baddbmm(chunk.bias, stacked, keys[:, read].transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1)  # float32 inside, rounded to bfloat16
        attended = torch.bmm(probs, values[:, read])
        attended = attended.view(num_kv_heads, group_size, chunk.padded_rows, head_size)
        out[chunk.start : chunk.end].view(rows, num_kv_heads, group_size, head_size).copy_(
            attended[:, :, :rows].permute(2, 0, 1, 3)
        )


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple
