"""One decoder layer's KV write and decode attention on the torch path, in microseconds.

SmolLM2-135M's attention shapes (9 query heads, 3 kv heads, head size 64, blocks of 128
tokens, the CPU's default), float32 or `--dtype bfloat16`: B sequences decoding one token
each at `--context` tokens, their blocks spread over a cache of 750 blocks stored as the
CPU's pool is (kv_cache.torch_path_layouts: weighed in place in bfloat16, and in float32 on
a CPU without AVX-512). Times `write_kv_cache_reference` (the step's new keys and values
into their slots, at the (block, offset) the plan worked out) and
`paged_attention_reference` with the step's plan built once, as every layer of a step runs
them; the median of `--repeats` rounds.

    python bench/decode_attention.py                    # B = 1, 16, 64 at 384 tokens
    python bench/decode_attention.py --batch 1 --context 1024
    python bench/decode_attention.py --dtype bfloat16 --batch 64 --context 320 --query-heads 3

`--query-heads` changes how many query heads share the 3 kv heads (SmolLM2: 9): in place
the bags weigh each kv head's slots once for every query head, so the time
follows the query heads, not the bytes read.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from aioserve.kernels.attention_reference import (
    paged_attention_reference,
    plan_reference_attention,
)
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts, write_kv_cache_reference

NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 3, 64, 128, 750


def median_us(fn, repeats: int, calls: int = 200) -> float:
    fn()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def measure(
    batch: int, context: int, repeats: int, dtype: torch.dtype, query_heads: int
) -> tuple[float, float]:
    """(KV write µs, attention µs) for `batch` decodes at `context` tokens."""
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = (
        empty_kv_cache(*shape, dtype, torch.device("cpu"), layout).copy_(
            torch.randn(shape, generator=gen)
        )
        for layout in torch_path_layouts(dtype)
    )
    blocks_per_seq = -(-context // BLOCK_SIZE)
    physical = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * blocks_per_seq]
    tables = physical.view(batch, blocks_per_seq).int().numpy()
    query_start_loc = np.arange(batch + 1, dtype=np.int32)
    seq_lens = np.full(batch, context, dtype=np.int32)
    last = context - 1
    slots = torch.from_numpy(tables[:, last // BLOCK_SIZE].astype(np.int64)) * BLOCK_SIZE
    slots += last % BLOCK_SIZE
    query = torch.randn(batch, query_heads, HEAD_SIZE, generator=gen).to(dtype)
    key = torch.randn(batch, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(batch, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    block_tables = torch.from_numpy(tables)
    plan = plan_reference_attention(
        query_start_loc, seq_lens, tables, BLOCK_SIZE, torch.device("cpu"), slots.numpy()
    )
    write = median_us(
        lambda: write_kv_cache_reference(
            key, value, key_cache, value_cache, slots, False, slot_index=plan.write_index
        ),
        repeats,
    )
    attend = median_us(
        lambda: paged_attention_reference(
            query,
            key_cache,
            value_cache,
            torch.from_numpy(query_start_loc),
            torch.from_numpy(seq_lens),
            block_tables,
            HEAD_SIZE**-0.5,
            1,
            context,
            plan=plan,
        ),
        repeats,
    )
    return write, attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--query-heads", type=int, default=9, help="a multiple of the 3 kv heads (SmolLM2: 9)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print("| sequences | context | KV write µs | attention µs |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for batch in args.batch:
            write, attend = measure(batch, args.context, args.repeats, dtype, args.query_heads)
            print(f"| {batch} | {args.context} | {write:.1f} | {attend:.1f} |")


if __name__ == "__main__":
    main()
