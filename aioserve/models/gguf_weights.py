"""A GGUF checkpoint's quantized weights kept as stored, on a GPU and on a CPU.

A decode step is bound by the bytes of weights it reads: the GGUF block types hold a
weight in 4.5 (Q4_0) to 8.5 (Q8_0) bits, bfloat16 in 16.

- On a GPU (`keep_gguf_blocks`) a Linear whose checkpoint tensors are all of one type the
  Triton kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: kernels/
  gguf_linear_reference.py GGUF_TYPES) holds their blocks as the file stores them, and the
  kernels of kernels/gguf_linear.py dequantize them in registers; its float weight is
  released (it keeps only its shape), so the layer's memory is the file's.
- On a CPU with bfloat16 arithmetic (`keep_int4_weights`) each Linear whose tensors are all
  4-bit (Q4_0, Q4_1) also gets the weights in the layout of torch's int4 CPU matmul
  (kernels/gguf_linear_reference.py `pack_int4`), read by products of up to
  linear.INT4_MAX_ROWS rows. Larger steps keep reading the bfloat16 weights that oneDNN
  holds packed: torch's int4 op walks the weight once per row, four times slower than
  bfloat16 at 64 rows. The copy costs about a third of the bfloat16 weights' memory. The
  other types have no such op and stay in float on a CPU.

The stacked layers (q/k/v, gate/up) take their shards in the order `load_weights` stacks
the float shards. A layer with a shard in a type outside the kernels' (F16, F32, Q2_K, ...),
on a GPU with shards of two types (a Q4_K_M file's Q4_K q/k beside a Q6_K v), or on the
CPU with a shard that is not 4-bit or of a shape torch's int4 layout does not take (output
rows not a multiple of 16), stays in float only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from aioserve.kernels.gguf_linear_reference import (
    FOUR_BIT_TYPES,
    GGUF_TYPES,
    fits_int4,
    pack_int4,
    unpack_blocks,
)
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.linear import Linear


def _block_layers(
    model: nn.Module, checkpoint: Checkpoint, qtypes: tuple[str, ...]
) -> Iterator[tuple[Linear, list[tuple[str, Tensor]]]]:
    """Each Linear of `model` whose checkpoint tensors are all stored in `qtypes`, with its
    shards' (type, blocks) in stacking order."""
    shards: dict[str, dict[int, tuple[str, Tensor]]] = {}
    for hf_name, qtype, blocks in checkpoint.gguf_blocks():
        target = model.parameter_for(hf_name) if qtype in qtypes else None
        if target is not None:
            name, shard = target
            shards.setdefault(name, {})[shard or 0] = (qtype, blocks)
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight"
        parts = shards.get(name, {})
        if isinstance(module, Linear) and parts and len(parts) == model.shard_count(name):
            yield module, [parts[i] for i in sorted(parts)]


@torch.no_grad()
def keep_gguf_blocks(model: nn.Module, checkpoint: Checkpoint) -> int:
    """Give each Linear of `model` whose checkpoint tensors are all of one GGUF block type
    those blocks, for the Triton kernels, and release its float weight; returns the blocks'
    bytes."""
    kept = 0
    for module, shards in _block_layers(model, checkpoint, GGUF_TYPES):
        qtypes = {qtype for qtype, _ in shards}
        if len(qtypes) != 1:
            continue
        blocks = torch.cat([blocks for _, blocks in shards])  # a row's blocks are its own
        module.gguf_blocks = blocks.to(module.weight.device)
        module.gguf_qtype = qtypes.pop()
        module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
        kept += module.gguf_blocks.nbytes
    return kept


@torch.no_grad()
def keep_int4_weights(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """Give each Linear of `model` whose checkpoint tensors are all 4-bit GGUF (Q4_0, Q4_1)
    its weights in torch's int4 layout, scales in `dtype` (the model's); returns the bytes
    they take."""
    added = 0
    for module, shards in _block_layers(model, checkpoint, FOUR_BIT_TYPES):
        if not fits_int4(module.out_features, module.in_features):
            continue
        unpacked = [unpack_blocks(blocks, qtype) for qtype, blocks in shards]
        codes, scale, zero = (torch.cat([part[j] for part in unpacked]) for j in range(3))
        packed, scales_and_zeros = pack_int4(codes, scale, zero, dtype)
        module.int4_weight = packed.to(module.weight.device)
        module.int4_scales_and_zeros = scales_and_zeros.to(module.weight.device)
        added += packed.nbytes + scales_and_zeros.nbytes
    return added
