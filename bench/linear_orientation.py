"""Which way round the CPU's float32 GEMM is faster for the dense layers, by batch size.

For each SmolLM2-135M weight shape (qkv 960×576, o 576×576, gate/up 3072×576, down
576×1536, output head 49152×576) and each number of rows, times x @ Wᵀ (F.linear) against
W @ xᵀ transposed back to a contiguous [rows, out] (what `aioserve.models.linear.dense`
does at or below SMALL_BATCH_ROWS), and prints GFLOPS for both. As in a model step, each
timing goes through one weight per layer (30 layers, the head once), so the weights come
from memory rather than a warm cache. The two are timed in alternation, repeat after
repeat, so that a noisy machine slows both alike.

    python bench/linear_orientation.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from aioserve.models.linear import SMALL_BATCH_ROWS

# name: (out_features, in_features, how many such weights a SmolLM2-135M step goes through)
SHAPES = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "head": (49152, 576, 1),
}


def input_first(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        F.linear(x, weight)


def weight_first(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        torch.mm(weight, x.t()).t().contiguous()


def alternate(fns, args: tuple, repeats: int) -> list[float]:
    """Median seconds of each fn(*args), the functions called in turn `repeats` times."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn(*args)  # warm-up
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn(*args)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; dense() turns at "
        f"{SMALL_BATCH_ROWS} rows"
    )
    print(f"{'shape':8s} {'rows':>5s} {'x@Wt GFLOPS':>12s} {'W@xt GFLOPS':>12s} {'ratio':>6s}")
    for name, (out_features, in_features, count) in SHAPES.items():
        weights = [torch.randn(out_features, in_features) for _ in range(count)]
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            linear_s, weight_first_s = alternate(
                [input_first, weight_first], (x, weights), args.repeats
            )
            flops = 2 * rows * out_features * in_features * count
            print(
                f"{name:8s} {rows:5d} {flops / linear_s / 1e9:12.0f} "
                f"{flops / weight_first_s / 1e9:12.0f} {linear_s / weight_first_s:6.2f}"
            )


if __name__ == "__main__":
    main()
