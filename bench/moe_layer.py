"""Time one MoE layer's experts on the CPU (kernels/moe_reference.py), aioserve alone: the
routed products of T tokens at a few T, with the experts plain and packed for oneDNN (as a
bfloat16 model on a CPU with bfloat16 arithmetic serves them), random routing.

    python bench/moe_layer.py [--experts 64 --top-k 8 --hidden 512 --moe-intermediate 256]

The defaults are bench/moe_model.py's checkpoint, whose served figures are in
bench/RESULTS.md; one layer's time times its 12 layers is the experts' share of a step.
"""

from __future__ import annotations

import argparse
import time

import torch

from aioserve.kernels.moe_reference import fused_moe_reference, pack_expert_weight, select_experts
from aioserve.models.linear import onednn_packs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    experts, hidden, inter = args.experts, args.hidden, args.moe_intermediate
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    packed = ([], [])
    if onednn_packs(dtype):
        packed = ([pack_expert_weight(w) for w in w13], [pack_expert_weight(w) for w in w2])
    print(f"{experts} experts, top {args.top_k}, hidden {hidden}, intermediate {inter}, {dtype}")
    print("| tokens | plain ms | packed ms |\n|---|---|---|")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, experts), args.top_k, True)
        row = [str(tokens)]
        for kept in ((), packed):
            if kept and not kept[0]:
                row.append("no oneDNN bf16")
                continue
            repeats = max(3, 200 // tokens)
            fused_moe_reference(x, w13, w2, weights, ids, *kept)
            started = time.perf_counter()
            for _ in range(repeats):
                fused_moe_reference(x, w13, w2, weights, ids, *kept)
            row.append(f"{(time.perf_counter() - started) / repeats * 1e3:.2f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
