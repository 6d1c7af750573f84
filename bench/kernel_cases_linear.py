"""The cases of the linear layers on GGUF 4-bit weights (aioserve/kernels/gguf_linear.py),
built for bench/kernel_cases.py.

Per model, the four products of a Llama decoder layer (`linear_layers`), in Q4_0 and Q4_1,
for each token batch (M rows) and dtype. A weight is built once and shared by its layer's
cases. Its blocks are random: every nibble byte uniform, d uniform in [2⁻⁹, 2⁻⁷) (a weight
spread of about ±0.03, as a real layer's) and, for Q4_1, m near −8d, so the weights
centre on zero.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioserve.kernels.gguf_linear import gguf_linear_triton
from aioserve.kernels.gguf_linear_reference import (
    BLOCK_BYTES,
    FOUR_BIT_TYPES,
    GROUP_SIZE,
    gguf_linear_reference,
)
from bench.kernel_case_types import Case, ModelShape, Random, TokenBatch, compare

# The minimum bytes, in the notation of kernel_cases.FORMULAS (M rows of x, N output
# columns, K inputs, e bytes per element of x); b bytes per block of 32 weights.
FORMULAS = {
    f"gguf_linear {qtype}": "x [M, K] read + blocks read + out [M, N] written: "
    f"M·K·e + N·K/32·{b} + M·N·e"
    for qtype, b in BLOCK_BYTES.items()
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


def random_blocks(rand: Random, n: int, k: int, qtype: str) -> Tensor:
    """uint8 [N, K / 32 * block bytes]: GGUF `qtype` blocks of random codes and scales."""
    groups = k // GROUP_SIZE
    # 16 nibble bytes a block, drawn as two random int64 each (8 times fewer draws).
    nibbles = rand.integers(-(2**63), 2**63 - 1, n, groups, 2).view(torch.uint8)
    scale = rand.uniform(n, groups, 1).mul_(3 / 512).add_(1 / 512)
    fields = [scale]
    if qtype == "q4_1":
        fields.append(scale * -8 * (0.9 + 0.2 * rand.uniform(n, groups, 1)))
    halves = [field.half().view(torch.uint8) for field in fields]
    return torch.cat([*halves, nibbles], dim=2).reshape(n, groups * BLOCK_BYTES[qtype])


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
    k = blocks.shape[1] // BLOCK_BYTES[qtype] * GROUP_SIZE
    x = rand.normal(batch.n, k, dtype=dtype)
    e = x.element_size()
    traffic = batch.n * k * e + blocks.numel() + batch.n * n * e  # M·K·e + N·K/32·b + M·N·e

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
    """Every layer of `model` in both 4-bit types, for each batch and dtype."""
    for layer, n, k in linear_layers(model):
        for qtype in FOUR_BIT_TYPES:
            blocks = random_blocks(rand, n, k, qtype)
            for batch in batches:
                for dtype in dtypes:
                    yield _case(rand, model, layer, blocks, qtype, batch, dtype)
