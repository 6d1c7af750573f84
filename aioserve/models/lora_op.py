"""A layer's LoRA products in the step, compiled or not: an opaque op that finds the step's
tokens grouped by adapter slot in the step context.

With --enable-lora a Linear holds its adapter slots as buffers (`lora_a` [slots, slices ·
rank, in], `lora_b` [slots, out, rank], runner/lora_slots.py) and adds, after its own
product, (x Aᵀ) Bᵀ for each token that has an adapter (kernels/lora.py). Which token has
which slot changes every step; under torch.compile the addition is therefore one custom op,
`aioserve::lora_add_`, that reads the step's groups when it runs, as the paged attention op
reads its caches: the compiled graphs stay the ones compiled at warm-up, a step without
adapters passes through it at the cost of a call, and the slots' weights are inputs of the
graph like the layer's own. Eagerly, the same function runs directly.

A decode step replayed from a CUDA/HIP graph would not run the op's body at all, so LoRA
turns decode graphs off (engine/build.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.lora import add_lora
from aioserve.models.step_context import current_lora_groups


def _add_step_lora(out: Tensor, x: Tensor, a: Tensor, b: Tensor, slice_bounds: list[int]) -> None:
    groups = current_lora_groups()
    if groups is not None:
        add_lora(out, x, a, b, tuple(slice_bounds), groups)


# Registered through torch.library.Library, as models/linear.py's packed_dense is: custom_op's
# Python layers cost a few microseconds more a call, and a step makes ~120 of these.
_LIBRARY = torch.library.Library("aioserve", "FRAGMENT")
_LIBRARY.define("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, int[] slice_bounds) -> ()")
_LIBRARY.impl("lora_add_", _add_step_lora, "CompositeExplicitAutograd")


@torch.library.register_fake("aioserve::lora_add_")
def _(out: Tensor, x: Tensor, a: Tensor, b: Tensor, slice_bounds: list[int]) -> None:
    return None


def add_step_lora(
    out: Tensor, x: Tensor, a: Tensor, b: Tensor, slice_bounds: tuple[int, ...]
) -> None:
    """out += the LoRA products of the step's tokens that have an adapter, in place."""
    if torch.compiler.is_compiling():
        torch.ops.aioserve.lora_add_(out, x, a, b, list(slice_bounds))
    else:
        _add_step_lora(out, x, a, b, list(slice_bounds))
