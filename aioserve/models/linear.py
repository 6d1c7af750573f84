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

On a CPU with bfloat16 arithmetic (AVX-512-BF16, AMX) a bfloat16 model's weights are handed
to oneDNN once, in its blocked layout (`pack_weights`), and every product runs oneDNN's
matmul on them (`torch.ops.mkldnn._linear_pointwise`, the op inductor's weight freezing
uses); torch's own bfloat16 product reorders the weight on every call. On a Xeon with AMX,
a step's 120 SmolLM2 layer products with the weights streaming from memory (`python
bench/packed_products.py`) took 18.4 → 12.0 ms at one row, 24.8 → 15.9 at 64, 44.7 → 29.5
at 256, and about the same from 512 rows up. Served, the one-stream decode step went from
31–32 to 29.7 ms; a 64-row step's products took as long as before (bench/RESULTS.md). The
plain weight is released (a Linear keeps only its shape), so the model's memory does not
grow; a tied output head keeps its plain table for the embedding and gets a packed copy,
which products of more than one row read (a compiled single row reads the table with the
multiply-reduce loop: as fast here, and no opaque op in a graph of the whole step).
Beside the packed weights, a GGUF checkpoint's Q4_0 / Q4_1 layers can be kept as stored
(models/gguf_weights.py): the same op then multiplies steps of up to INT4_MAX_ROWS rows by
them with torch's int4 CPU matmul, reading a third of the bytes. On a GPU a GGUF layer
holds only its blocks (Q4_0 ... Q6_K), multiplied by the Triton kernels of
kernels/gguf_linear.py; an AWQ or GPTQ checkpoint's layers hold only their 4-bit weights,
multiplied by those of kernels/int4_group_linear.py (models/int4_group_weights.py), an FP8
checkpoint's (or `--quantization fp8`'s) only their 8-bit weights, multiplied by
kernels/fp8_linear.py's, or kernels/fp8_block_linear.py's for block-wise scales
(models/fp8_weights.py). An INT8 W8A8 checkpoint's layers hold only
their int8 weights on a CPU with VNNI or AMX too, multiplied by kernels/int8_linear.py
(torch's int8 GEMM there, models/int8_weights.py).

In batch-invariant mode (VLLM_BATCH_INVARIANT=1) the CPU computes every product in tiles of
INVARIANT_TILE_ROWS rows, the last padded: MKL picks its blocking by shape, so a row's bits
then do not depend on how many rows share its product. A GPU (and the Triton backend)
takes the fixed-tile GEMM of kernels/dense_linear.py instead of cuBLAS/hipBLASLt.

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
from aioserve.kernels.dense_linear import dense_linear_triton
from aioserve.kernels.fp8_block_linear import fp8_block_linear
from aioserve.kernels.fp8_linear import fp8_linear
from aioserve.kernels.gguf_linear import gguf_linear
from aioserve.kernels.gguf_linear_reference import int4_linear
from aioserve.kernels.int4_group_linear import int4_group_linear
from aioserve.kernels.int8_linear import int8_linear
from aioserve.models.lora_op import add_step_lora
from aioserve.platform import cpu_flags

# At or below this many rows the CPU computes W @ xᵀ (the crossover measured at 128–256).
SMALL_BATCH_ROWS = 128

INVARIANT_TILE_ROWS = 16

# The row count oneDNN lays a packed weight out for; 1, 64 and 2,048 measured alike.
PACKED_FOR_ROWS = 64


def int4_max_rows(flags: frozenset[str]) -> int:
    """Up to how many rows a product reads a GGUF 4-bit checkpoint's weights as stored,
    where the model keeps them (models/gguf_weights.py), on a CPU with `flags`: torch's int4
    op walks the weight once per row, and the rows where it still beats oneDNN's bfloat16
    product on packed weights depend on that product (`python bench/packed_products.py`,
    SmolLM2's 120 layer products). With AMX tiles (a Xeon) it gained 2-3x at one to four
    rows and nothing from about eight on. With AVX-512-BF16 alone (a Zen 5 EPYC), 3.8
    against 8.0 ms at four rows, 5.8-6.1 against 7.8-9.0 at five to eight, even at twelve,
    behind at sixteen: eight there, so that a step of a few sequences, or one sequence and
    its drafts (engine/speculation.py), still reads a third of the bytes."""
    return 4 if "amx_bf16" in flags else 8


INT4_MAX_ROWS = int4_max_rows(cpu_flags())


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN multiplies `dtype` weights held in its blocked layout."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# Registered through torch.library.Library rather than custom_op: the compiled step calls
# it ~120 times a token, and custom_op's Python layers cost ~4 us more a call.
_LIBRARY = torch.library.Library("aioserve", "FRAGMENT")
_LIBRARY.define(
    "packed_dense(Tensor x, Tensor packed_weight, Tensor? bias, Tensor? int4_weight, "
    "Tensor? int4_scales_and_zeros) -> Tensor"
)


def _packed_product(
    x: Tensor,
    packed_weight: Tensor,
    bias: Tensor | None,
    int4_weight: Tensor | None,
    int4_scales_and_zeros: Tensor | None,
) -> Tensor:
    # Decided here, at run time, rather than in the traced code: a branch on the row count
    # there would split the compiled graph for every count into two.
    if int4_weight is not None and x.shape[0] <= INT4_MAX_ROWS:
        return int4_linear(x, int4_weight, int4_scales_and_zeros, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_LIBRARY.impl("packed_dense", _packed_product, "CompositeExplicitAutograd")


@torch.library.register_fake("aioserve::packed_dense")
def _(
    x: Tensor,
    packed_weight: Tensor,
    bias: Tensor | None,
    int4_weight: Tensor | None,
    int4_scales_and_zeros: Tensor | None,
) -> Tensor:
    return x.new_empty((x.shape[0], packed_weight.shape[0]))


def _packed_dense(
    x: Tensor,
    packed_weight: Tensor,
    bias: Tensor | None,
    int4_weight: Tensor | None,
    int4_scales_and_zeros: Tensor | None,
) -> Tensor:
    """x @ weightᵀ (+ bias) by oneDNN on its packed weight, or for a few rows by torch's int4
    op on the 4-bit weights when the model keeps them: an opaque op under torch.compile
    (inductor would not pass an opaque tensor to its own kernels), a direct call eagerly."""
    if torch.compiler.is_compiling():
        rows = x.shape[0]
        if int4_weight is not None and not isinstance(rows, torch.SymInt) and rows <= INT4_MAX_ROWS:
            # A graph of a fixed row count calls torch's int4 op itself: no Python between
            # it and the generated code (runner/one_row_step.py compiles such a graph).
            return int4_linear(x, int4_weight, int4_scales_and_zeros, bias)
        return torch.ops.aioserve.packed_dense(
            x, packed_weight, bias, int4_weight, int4_scales_and_zeros
        )
    return _packed_product(x, packed_weight, bias, int4_weight, int4_scales_and_zeros)


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


def _one_compiled_row(x: Tensor) -> bool:
    """Whether x is a single row, in a graph being compiled for that row count."""
    return (
        torch.compiler.is_compiling()
        and x.dim() == 2
        and not isinstance(x.shape[0], torch.SymInt)
        and x.shape[0] == 1
    )


def _row_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [1, in] @ weightᵀ as a multiply-reduce, which inductor turns into one loop over the
    weight, reading it at memory speed (MKL's GEMV gets about half of that here)."""
    out = (x * weight).sum(dim=1, dtype=torch.float32).to(x.dtype).unsqueeze(0)
    return out if bias is None else out + bias


def dense(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    row_weight: Tensor | None = None,
    packed_weight: Tensor | None = None,
    int4_weight: Tensor | None = None,
    int4_scales_and_zeros: Tensor | None = None,
) -> Tensor:
    """x [T, in] @ weight [out, in]ᵀ (+ bias [out]) as a contiguous [T, out].

    row_weight, when given, holds the weight's values, in a narrower dtype on a float32
    model, read instead of it by the compiled single-row product; packed_weight, when
    given, holds them in oneDNN's layout and is read instead of `weight` (see
    `pack_weights`) except by that product when row_weight is given; with it, the int4 pair
    holds a GGUF 4-bit checkpoint's weights as stored, read instead for steps of up to
    INT4_MAX_ROWS rows (models/gguf_weights.py).
    """
    if packed_weight is not None:
        if row_weight is not None and _one_compiled_row(x):
            # Inductor's loop reads the weight as fast as oneDNN does, and a graph of the
            # whole step (runner/one_row_step.py) then calls no Python for it.
            return _row_product(x, row_weight, bias)
        return _packed_dense(x, packed_weight, bias, int4_weight, int4_scales_and_zeros)
    if dispatch.batch_invariant() and x.dim() == 2:
        if dispatch.use_triton():
            return dense_linear_triton(x, weight, bias)
        return _dense_in_row_tiles(x, weight, bias)
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    if _one_compiled_row(x):
        return _row_product(x, weight if row_weight is None else row_weight, bias)
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
        self.register_buffer("packed_weight", None, persistent=False)
        self.register_buffer("int4_weight", None, persistent=False)
        self.register_buffer("int4_scales_and_zeros", None, persistent=False)
        # On a GPU, a GGUF checkpoint's blocks in place of the weight, and their type
        # (models/gguf_weights.py `keep_gguf_blocks`).
        self.register_buffer("gguf_blocks", None, persistent=False)
        self.gguf_qtype: str | None = None
        # On a GPU, an AWQ / GPTQ checkpoint's 4-bit weights in place of the weight, in the
        # kernels' layout (models/int4_group_weights.py `keep_int4_group_weights`).
        self.register_buffer("quant_qweight", None, persistent=False)
        self.register_buffer("quant_scales", None, persistent=False)
        self.register_buffer("quant_zeros", None, persistent=False)
        self.register_buffer("quant_perm", None, persistent=False)
        self.quant_group_size = 0
        # On a GPU, FP8 weights in place of the weight, with float32 scales [1] or one a
        # row, or with fp8_block (rows, columns) one a block (models/fp8_weights.py).
        self.register_buffer("fp8_weight", None, persistent=False)
        self.register_buffer("fp8_scale", None, persistent=False)
        self.fp8_block: tuple[int, int] | None = None
        # On a GPU and a CPU with VNNI or AMX, INT8 weights in place of the weight, with
        # float32 scales [1] or one a row (models/int8_weights.py).
        self.register_buffer("int8_weight", None, persistent=False)
        self.register_buffer("int8_scale", None, persistent=False)
        # With --enable-lora, the adapter slots' weights of this layer and its slices'
        # output columns (runner/lora_slots.py, models/lora_op.py).
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_slice_bounds: tuple[int, ...] = ()

    def reset_parameters(self) -> None:
        """Nothing: the loader fills the parameters."""

    def forward(self, x: Tensor) -> Tensor:
        out = self._base_product(x)
        if self.lora_a is not None:
            add_step_lora(out, x, self.lora_a, self.lora_b, self.lora_slice_bounds)
        return out

    def _base_product(self, x: Tensor) -> Tensor:
        if self.gguf_blocks is not None:
            return gguf_linear(x, self.gguf_blocks, self.gguf_qtype, self.bias)
        if self.fp8_weight is not None:
            if self.fp8_block is not None:
                return fp8_block_linear(
                    x, self.fp8_weight, self.fp8_scale, self.fp8_block, self.bias
                )
            return fp8_linear(x, self.fp8_weight, self.fp8_scale, self.bias)
        if self.int8_weight is not None:
            return int8_linear(x, self.int8_weight, self.int8_scale, self.bias)
        if self.quant_qweight is not None:
            return int4_group_linear(
                x,
                self.quant_qweight,
                self.quant_scales,
                self.quant_zeros,
                self.quant_perm,
                self.quant_group_size,
                self.bias,
            )
        return dense(
            x,
            self.weight,
            self.bias,
            self.row_weight,
            self.packed_weight,
            self.int4_weight,
            self.int4_scales_and_zeros,
        )


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
    """Give every Linear of `model` (but those holding INT8 weights) a `dtype` copy of its
    weight for single-row products.

    Returns the bytes the copies take. A model whose output head is its tied input
    embedding keeps that copy itself (see LlamaForCausalLM.compute_logits).
    """
    added = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.int8_weight is None:
            module.row_weight = rounded_copy(module.weight, dtype)
            added += module.row_weight.nbytes
    if getattr(model, "tie_word_embeddings", False):
        model.head_row_weight = rounded_copy(model.embed_tokens.weight, dtype)
        added += model.head_row_weight.nbytes
    return added


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


@torch.no_grad()
def pack_weights(model: nn.Module) -> int:
    """Hand every Linear's weight of `model` (but those holding INT8 weights) to oneDNN in
    its blocked layout (onednn_packs must hold for their dtype) and release the plain
    weight, of which a Linear then keeps only the shape. A tied output head gets a packed
    copy of the embedding table.

    Returns the bytes the copies take (the head's).
    """
    for module in model.modules():
        if isinstance(module, Linear) and module.int8_weight is None:
            module.packed_weight = _pack(module.weight)
            module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
    if not getattr(model, "tie_word_embeddings", False):
        return 0
    model.head_packed_weight = _pack(model.embed_tokens.weight)
    return model.embed_tokens.weight.nbytes
