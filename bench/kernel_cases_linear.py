"""The cases of the linear layers on GGUF quantized weights (aioserve/kernels/gguf_linear.py),
built for bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (`linear_layers`), in every GGUF type
the kernels take (the k-quants where K is a multiple of 256), for each token batch (M rows)
and dtype. A weight is built once and shared by its layer's cases. Its blocks are random:
every byte uniform but for the fp16 scales (`_SCALES`), drawn so that a weight spreads about
±0.03, as a real layer's does, and the minimums near minus the middle code's weight, so
the weights centre on zero.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels.gguf_linear import gguf_linear_triton
from aioserve.kernels.gguf_linear_reference import (
    BLOCK_LAYOUT,
    GGUF_TYPES,
    gguf_linear_reference,
)
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare

# The minimum bytes, in the notation of kernel_cases.FORMULAS (M rows of x, N output
# columns, K inputs, e bytes per element of x); b bytes per block of w weights.
FORMULAS = {
    f"gguf_linear {qtype}": "x [M, K] read + blocks read + out [M, N] written: "
    f"M·K·e + N·K/{w}·{b} + M·N·e"
    for qtype, (w, b) in BLOCK_LAYOUT.items()
}
# The fp16 fields of a block, (byte, low, high): d uniform in [low, high), then a minimum
# (Q4_1, Q5_1: w = d q + m; k-quants: w = d sc q - dmin m) as d times a uniform in
# [low, high). d sets a weight's spread to about ±0.03: d times half the codes' range
# (k-quants: times a 6-bit sub-scale of ~32, Q6_K an int8 one of ~64); the minimum is about
# minus the middle code's weight.
_SCALES = {
    "q4_0": ((0, 2**-9, 2**-7),),
    "q4_1": ((0, 2**-9, 2**-7), (2, -8.8, -7.2)),
    "q5_0": ((0, 2**-10, 2**-8),),
    "q5_1": ((0, 2**-10, 2**-8), (2, -17.6, -14.4)),
    "q8_0": ((0, 2**-13, 2**-11),),
    "q4_k": ((0, 2**-15, 2**-13), (2, 7.2, 8.8)),
    "q5_k": ((0, 2**-16, 2**-14), (2, 14.4, 17.6)),
    "q6_k": ((208, 2**-17, 2**-15),),
}


def linear_layers(model: ModelShape) -> tuple[tuple[str, int, int], ...]:
    """(name, N, K) of each product of one decoder layer: the fused qkv and gate/up
    projections, the attention output and the MLP's down projection."""
    q_size, kv_size = model.q_heads * model.head, model.kv_heads * model.head
    return (
        ("qkv", q_size + 2 * kv_size, model.hidden),
        ("o", model.hidden, q_size),
        ("gate/up", 2 * model.intermediate, model.hidden),
        ("down", model.hidden, model.intermediate),
    )


def _uniform(rand: Random, n: int, count: int, low: float, high: float) -> Tensor:
    return rand.uniform(n, count, 1).mul_(high - low).add_(low)


def random_blocks(rand: Random, n: int, k: int, qtype: str) -> Tensor:
    """uint8 [N, K / w * b]: GGUF `qtype` blocks of random codes and scales (`_SCALES`)."""
    block_weights, block_bytes = BLOCK_LAYOUT[qtype]
    count = k // block_weights
    blocks = rand.bytes(n, count, block_bytes)
    (d_at, *d_range), *minimum = _SCALES[qtype]
    d = _uniform(rand, n, count, *d_range)
    blocks[:, :, d_at : d_at + 2] = d.half().view(torch.uint8)
    for at, low, high in minimum:
        blocks[:, :, at : at + 2] = (
            (d * _uniform(rand, n, count, low, high)).half().view(torch.uint8)
        )
    return blocks.reshape(n, count * block_bytes)


def _case(
    rand: Random,
    model: ModelShape,
    layer: str,
    blocks: Tensor,
    qtype: str,
    batch: TokenBatch,
    dtype: torch.dtype,
) -> Case:
    n = blocks.shape[0]
    block_weights, block_bytes = BLOCK_LAYOUT[qtype]
    k = blocks.shape[1] // block_bytes * block_weights
    x = rand.normal(batch.n, k, dtype=dtype)
    e = x.element_size()
    traffic = batch.n * k * e + blocks.numel() + batch.n * n * e  # M·K·e + N·K/w·b + M·N·e

    def check() -> str | None:
        out = gguf_linear_triton(x, blocks, qtype)
        return compare(out, gguf_linear_reference(x, blocks, qtype), dtype)

    return Case(
        f"gguf_linear {qtype}",
        model.name,
        f"{layer}, {batch.label}",
        dtype,
        traffic,
        2 * batch.n * n * k,
        lambda: gguf_linear_triton(x, blocks, qtype),
        check,
    )


def gguf_linear_cases(
    rand: Random,
    model: ModelShape,
    batches: tuple[TokenBatch, ...],
    dtypes: tuple[torch.dtype, ...],
) -> Iterator[Case]:
    """Every layer of `model` in every GGUF type whose blocks its rows fill, for each batch
    and dtype. (A k-quant takes rows of whole 256-weight super-blocks: llama.cpp stores the
    others, SmolLM2's 576-wide ones, in a 32-weight type.)"""
    for layer, n, k in linear_layers(model):
        for qtype in GGUF_TYPES:
            if k % BLOCK_LAYOUT[qtype][0]:
                continue
            blocks = random_blocks(rand, n, k, qtype)
            for batch in batches:
                for dtype in dtypes:
                    yield _case(rand, model, layer, blocks, qtype, batch, dtype)
