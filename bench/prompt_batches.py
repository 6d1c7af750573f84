"""One layer's prefill attention of P fresh prompts: one SDPA call each, against one call
for them all (kernels/prefill_sequences.py), in milliseconds.

SmolLM2-135M's attention shapes (9 query heads, 3 kv heads, head size 64) by default, the
prompts' keys and values read from the step's new rows as a fresh prompt's are. Each
round times both ways in turn (one by one in batch-invariant mode, which batches none);
the medians of --rounds rounds are printed, and whether the two gave the same bits. Only
a length that is a multiple of 16 is batched: others take the same way both times.

    python bench/prompt_batches.py --prompts 16 --length 256
    python bench/prompt_batches.py --prompts 64 --length 64 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from aioserve.kernels import dispatch
from aioserve.kernels.attention_reference import (
    paged_attention_reference,
    plan_reference_attention,
)
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--query-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="layers timed in a round")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    block_size = 128
    count, length = args.prompts, args.length
    rows = count * length
    query = torch.randn(rows, args.query_heads, args.head_size).to(dtype)
    new_kv = tuple(torch.randn(rows, args.kv_heads, args.head_size).to(dtype) for _ in range(2))
    blocks = -(-length // block_size)
    shape = (count * blocks + 1, block_size, args.kv_heads, args.head_size)
    key_cache, value_cache = (
        empty_kv_cache(*shape, dtype, torch.device("cpu"), layout)
        for layout in torch_path_layouts(dtype)
    )
    starts = torch.arange(0, rows + 1, length, dtype=torch.int32)
    seq_lens = torch.full((count,), length, dtype=torch.int32)
    tables = torch.arange(1, count * blocks + 1, dtype=torch.int32).view(count, blocks)

    def one_step_plan():
        return plan_reference_attention(
            starts.numpy(), seq_lens.numpy(), tables.numpy(), block_size, query.device
        )

    def one_layer(plan) -> torch.Tensor:
        return paged_attention_reference(
            query,
            key_cache,
            value_cache,
            starts,
            seq_lens,
            tables,
            args.head_size**-0.5,
            length,
            length,
            plan=plan,
            new_kv=new_kv,
        )

    def ms_per_layer() -> float:
        """A step's layers: the plan made once, worked out in the first layer (untimed)."""
        plan = one_step_plan()
        one_layer(plan)
        started = time.perf_counter()
        for _ in range(args.calls):
            one_layer(plan)
        return (time.perf_counter() - started) / args.calls * 1e3

    times: dict[str, list[float]] = {"one by one": [], "batched": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for way, invariant in (("one by one", True), ("batched", False)):
                # Batch-invariant mode keeps each prompt's call its own; the decodes the
                # mode would also change are absent here.
                dispatch.set_batch_invariant(invariant)
                times[way].append(ms_per_layer())
        dispatch.set_batch_invariant(True)
        alone = one_layer(one_step_plan())
        dispatch.set_batch_invariant(False)
        same = torch.equal(alone, one_layer(one_step_plan()))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"{count} prompts of {length} tokens, same bits: {same}"
    )
    for way, values in times.items():
        print(f"{way:>10}: {statistics.median(values):.2f} ms a layer")


if __name__ == "__main__":
    main()
