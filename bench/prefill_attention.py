"""One layer's causal prefill attention on the CPU, the torch path against torch's own ops.

SmolLM2-135M's shapes (9 query heads over 3 kv heads, head size 64), bfloat16: B prompts of
L tokens, nothing cached before them. Times, in milliseconds a layer (the median of
`--repeats` rounds):

- `products`: what the engine runs (kernels/prefill_products.py), prompt by prompt, with
  its chunk sizes or those given by --chunk-rows / --key-align (smaller chunks skip more of
  the blocks above the diagonal and make more calls);
- `sdpa`: `scaled_dot_product_attention`, causal, all prompts in one call;
- `flex` (with --flex): compiled `flex_attention` with a causal block mask, all prompts in
  one call (its compile, ~5 s, is not timed).

Each method's output is checked against the products' (bfloat16: within 0.05).

    python bench/prefill_attention.py
    python bench/prefill_attention.py --prompts 8 --length 512 --chunk-rows 128 --key-align 128
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from decode_attention import median_us

from aioserve.kernels import prefill_products

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64
SCALE = HEAD_SIZE**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--chunk-rows", type=int, default=prefill_products.CHUNK_ROWS)
    parser.add_argument("--key-align", type=int, default=prefill_products.KEY_ALIGN)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flex", action="store_true", help="also compiled flex attention")
    args = parser.parse_args()
    prefill_products.CHUNK_ROWS = args.chunk_rows
    prefill_products.KEY_ALIGN = args.key_align

    n, length = args.prompts, args.length
    group = NUM_Q_HEADS // NUM_KV_HEADS
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(n, length, NUM_Q_HEADS, HEAD_SIZE, generator=gen).bfloat16()
    keys, values = (
        torch.randn(n, NUM_KV_HEADS, length, HEAD_SIZE, generator=gen).bfloat16() for _ in range(2)
    )
    # The products read keys zero-padded to whole KEY_ALIGN runs, as the engine pads them.
    padded = prefill_products.padded_key_count(length)
    padded_keys, padded_values = (F.pad(t, (0, 0, 0, padded - length)) for t in (keys, values))
    chunks = prefill_products.plan_chunks(length, length, group, torch.device("cpu"))
    out = torch.empty_like(query)

    def products() -> torch.Tensor:
        for i in range(n):
            prefill_products.attend_by_products(
                query[i], padded_keys[i], padded_values[i], chunks, SCALE, out[i]
            )
        return out

    heads_first = query.transpose(1, 2)  # [n, Hq, L, D]

    def sdpa() -> torch.Tensor:
        attended = F.scaled_dot_product_attention(
            heads_first, keys, values, is_causal=True, scale=SCALE, enable_gqa=True
        )
        return attended.transpose(1, 2)

    methods: dict[str, Callable[[], torch.Tensor]] = {"products": products, "sdpa": sdpa}
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(
            lambda b, h, q, k: q >= k, None, None, length, length, device="cpu"
        )
        compiled = torch.compile(flex_attention)

        def flex() -> torch.Tensor:
            attended = compiled(
                heads_first, keys, values, block_mask=mask, scale=SCALE, enable_gqa=True
            )
            return attended.transpose(1, 2)

        methods["flex"] = flex

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, bfloat16, {n} prompts of "
        f"{length} tokens, products in chunks of {args.chunk_rows} rows, keys aligned to "
        f"{args.key_align}"
    )
    print("| method | ms a layer | max difference from the products |")
    print("|---|---|---|")
    with torch.inference_mode():
        reference = products().clone()
        for name, fn in methods.items():
            difference = (fn().float() - reference.float()).abs().max().item()
            assert difference < 0.05, (name, difference)
            milliseconds = median_us(fn, args.repeats, calls=10) / 1e3
            print(f"| {name} | {milliseconds:.2f} | {difference:.3g} |")


if __name__ == "__main__":
    main()
