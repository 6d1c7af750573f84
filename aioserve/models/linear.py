"""Dense layers, y = x Wᵀ + b, through torch's GEMM with the operands ordered for the CPU.

Under torch.compile, a single row (decode at one stream) is written as a multiply-reduce
instead: inductor makes it one vectorized loop that reads the weight at close to memory
speed, 20–30 GB/s against MKL's ~14 GB/s GEMV on this project's 2-core CPUs (the output
head of SmolLM2: 8.1 → 3.8 ms).

MKL's float32 GEMM on this project's CPUs is up to 1.4× faster on a decode-sized batch when
the weight's many rows are the product's long side: Wᵀ computed as W @ xᵀ and transposed
back, rather than x @ Wᵀ. At 64 rows, with the weights coming from memory as in a model
step (`python bench/linear_orientation.py`): gate/up 60 → 86 GFLOPS, qkv 73 → 94, the
output head 49 → 61, o and down within 5%. From a few hundred rows up x @ Wᵀ is as fast
or faster, and GPUs get F.linear as it is.

On a CPU without bfloat16 arithmetic, `--dtype auto` computes in float32 but can keep a
bfloat16 copy of each weight for the single-row product (`keep_row_weights`): inductor's
loop converts it to float32 in registers, so it reads half the bytes, which is what a
one-stream decode is bound by (SmolLM2: 33 → 26 ms a token). The float32 weights are
rounded to the same bfloat16 values, so a row gets the same weights whichever product
computes it.

In batch-invariant mode (VLLM_BATCH_INVARIANT=1, CPU only so far) every product is computed
in tiles of INVARIANT_TILE_ROWS rows, the last padded: MKL picks its blocking by shape, so a
row's bits then do not depend on how many rows share its product.

Linear and Embedding leave their parameters uninitialized (torch.empty), as every
parameter of a model here is: the loader fills them all, from the checkpoint or with small
random values for `--load-format dummy`, and refuses a checkpoint that lacks one (torch's
random initialization took 0.9 s of the default model's start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aioserve.kernels import dispatch

# At or below this many rows the CPU computes W @ xᵀ (the crossover measured at 128–256).
SMALL_BATCH_ROWS = 128

INVARIANT_TILE_ROWS = 16


def _dense_in_row_tiles(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weightᵀ (+ bias), every product W @ tileᵀ of one shape (batch-invariant mode)."""
    rows = x.shape[0]
    tiles = -(-rows // INVARIANT_TILE_ROWS)
    padded = x.new_zeros(tiles * INVARIANT_TILE_ROWS, x.shape[1])
    padded[:rows] = x
    out = x.new_empty(tiles * INVARIANT_TILE_ROWS, weight.shape[0])
    for start in range(0, padded.shape[0], INVARIANT_TILE_ROWS):
        tile = padded[start : start + INVARIANT_TILE_ROWS]
        out[start : start + INVARIANT_TILE_ROWS] = torch.mm(weight, tile.t()).t()
    out = out[:rows]
    return out if bias is None else out + bias


def dense(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, row_weight: Tensor | None = None
) -> Tensor:
    """x [T, in] @ weight [out, in]ᵀ (+ bias [out]) as a contiguous [T, out].

    row_weight, when given, holds the weight's values in a narrower dtype, read instead of
    it by the compiled single-row product.
    """
    if dispatch.batch_invariant() and x.dim() == 2:
        return _dense_in_row_tiles(x, weight, bias)
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1 and torch.compiler.is_compiling():
        # One row: a multiply-reduce that inductor turns into one loop over the weight,
        # reading it at memory speed (MKL's GEMV gets about half of that here).
        if row_weight is not None:
            weight = row_weight
        out = (x * weight).sum(dim=1, dtype=torch.float32).to(x.dtype).unsqueeze(0)
        return out if bias is None else out + bias
    if bias is None:
        out_t = torch.mm(weight, x.t())
    else:
        out_t = torch.addmm(bias.unsqueeze(1), weight, x.t())
    return out_t.t().contiguous()


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose product goes through `dense`;
    its parameters start uninitialized."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("row_weight", None, persistent=False)

    def reset_parameters(self) -> None:
        """Nothing: the loader fills the parameters."""

    def forward(self, x: Tensor) -> Tensor:
        return dense(x, self.weight, self.bias, self.row_weight)


class Embedding(nn.Embedding):
    """nn.Embedding whose table starts uninitialized."""

    def reset_parameters(self) -> None:
        """Nothing: the loader fills the table."""


@torch.no_grad()
def rounded_copy(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`weight` in `dtype`; `weight` itself is rounded to the same values in place."""
    narrow = weight.to(dtype)
    weight.copy_(narrow)
    return narrow


def keep_row_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every Linear of `model` a `dtype` copy of its weight for single-row products.

    Returns the bytes the copies take. A model whose output head is its tied input
    embedding keeps that copy itself (see LlamaForCausalLM.compute_logits).
    """
    added = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.row_weight = rounded_copy(module.weight, dtype)
            added += module.row_weight.nbytes
    if getattr(model, "tie_word_embeddings", False):
        model.head_row_weight = rounded_copy(model.embed_tokens.weight, dtype)
        added += model.head_row_weight.nbytes
    return added
