"""A model step's dense products in bfloat16: torch's F.linear against oneDNN on packed weights,
and against 4-bit weights through torch's weight-only int4 CPU op.

The 120 products of SmolLM2's 30 decoder layers (qkv, o, gate/up, down), each layer with
weights of its own so that they stream from memory as in a served step, at several row
counts: F.linear (torch reorders each weight for oneDNN on every call) against
`torch.ops.mkldnn._linear_pointwise` on weights packed once (models/linear.py
`pack_weights`). Only on a CPU with bfloat16 arithmetic (AVX-512-BF16, AMX).

The int4 column is what keeping the default model's Q4_1 weights quantized could give
(issue 15): random 4-bit weights in groups of 32 along the input, a bfloat16 scale and zero
per group (Q4_1's layout: w = d * q + m is (q - 8) * d + (m + 8d)), multiplied by
`torch.ops.aten._weight_int4pack_mm_for_cpu`.

    python bench/packed_products.py --rows 1,64,256,512,2048
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from aioserve.models.linear import PACKED_FOR_ROWS, onednn_packs

SMOLLM2_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
LAYERS = 30


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)


def packed_product(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _int4(shape: tuple[int, int]) -> functools.partial:
    """A product with random Q4_1-like weights of `shape`, through torch's int4 CPU op."""
    n_out, n_in = shape
    q = torch.randint(0, 16, (n_out, n_in), dtype=torch.int32)
    scale = torch.rand(n_in // 32, n_out) * 0.01
    scales_and_zeros = torch.stack([scale, scale * 0.5], dim=-1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return functools.partial(int4_product, packed, scales_and_zeros)


def int4_product(packed: torch.Tensor, scales_and_zeros: torch.Tensor, x: torch.Tensor):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)


def per_step_ms(products, inputs: list[torch.Tensor], repeats: int) -> float:
    """Milliseconds for one pass over every layer's products."""

    def one_step() -> None:
        for layer in products:
            for x, product in zip(inputs, layer, strict=True):
                product(x)

    one_step()
    started = time.perf_counter()
    for _ in range(repeats):
        one_step()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,512,2048")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not onednn_packs(torch.bfloat16):
        raise SystemExit("this CPU's oneDNN has no bfloat16 packed products")
    torch.set_num_threads(args.threads)
    weights = [
        [torch.randn(shape, dtype=torch.bfloat16) * 0.05 for shape in SMOLLM2_LAYER]
        for _ in range(LAYERS)
    ]
    plain = [[functools.partial(F.linear, weight=w) for w in layer] for layer in weights]
    packed = [[functools.partial(packed_product, _pack(w)) for w in layer] for layer in weights]
    int4 = [[_int4(shape) for shape in SMOLLM2_LAYER] for _ in range(LAYERS)]
    print(f"{LAYERS} layers x {len(SMOLLM2_LAYER)} products, bfloat16, {args.threads} threads")
    print("rows  F.linear ms  packed ms  int4 ms")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, n_in, dtype=torch.bfloat16) for _, n_in in SMOLLM2_LAYER]
            repeats = 10 if rows < 512 else 3
            print(
                f"{rows:4d}  {per_step_ms(plain, inputs, repeats):11.2f}"
                f"  {per_step_ms(packed, inputs, repeats):9.2f}"
                f"  {per_step_ms(int4, inputs, repeats):7.2f}"
            )


if __name__ == "__main__":
    main()
