"""A GGUF checkpoint's 4-bit weights kept as stored, for the small steps of a CPU.

A one-stream decode step is bound by the bytes of weights it reads. Q4_0 and Q4_1 hold a
weight in 4.5–5 bits, bfloat16 in 16, so on a CPU with bfloat16 arithmetic every Linear
whose checkpoint tensors are all Q4_0/Q4_1 also gets them in the layout of torch's int4 CPU
matmul (kernels/gguf_linear_reference.py `pack_int4`), read by products of up to
linear.INT4_MAX_ROWS rows. Larger steps keep reading the bfloat16 weights that oneDNN holds
packed: torch's int4 op walks the weight once per row, four times slower than bfloat16 at
64 rows. The 4-bit copy costs about a third of the bfloat16 weights' memory.

The stacked layers (q/k/v, gate/up) take their shards' codes, scales and zeros
concatenated in the order `load_weights` stacks the float shards; a layer with a shard in
another type (a Q4_K_M file's Q6_K tensors), or of a shape torch's int4 layout does not
take (output rows not a multiple of 16), stays bfloat16 only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aioserve.kernels.gguf_linear_reference import fits_int4, pack_int4, unpack_blocks
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.linear import Linear


@torch.no_grad()
def keep_int4_weights(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """Give each Linear of `model` whose checkpoint tensors are all 4-bit GGUF its weights in
    torch's int4 layout, scales in `dtype` (the model's); returns the bytes they take."""
    shards: dict[str, dict[int, tuple[Tensor, Tensor, Tensor]]] = {}
    for hf_name, qtype, blocks in checkpoint.four_bit_weights():
        target = model.parameter_for(hf_name)
        if target is None:
            continue
        name, shard = target
        shards.setdefault(name, {})[shard or 0] = unpack_blocks(blocks, qtype)
    added = 0
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight"
        parts = shards.get(name, {})
        if not isinstance(module, Linear) or len(parts) != model.shard_count(name):
            continue
        if not fits_int4(module.out_features, module.in_features):
            continue
        codes, scale, zero = (torch.cat([parts[i][j] for i in sorted(parts)]) for j in range(3))
        packed, scales_and_zeros = pack_int4(codes, scale, zero, dtype)
        module.int4_weight = packed.to(module.weight.device)
        module.int4_scales_and_zeros = scales_and_zeros.to(module.weight.device)
        added += packed.nbytes + scales_and_zeros.nbytes
    return added
