"""What every attention layer of the step being run shares: its KV caches and the layout of
its tokens over them.

The runner sets it around each forward pass (`with step_context(meta, kv_caches): ...`) and
each layer's attention reads it (`current_step()`), so that the model's forward takes only
token ids and positions. With LoRA adapters in the step, it also says which tokens use
which adapter slot, which every LoRA layer reads (`current_lora_groups()`). That keeps the KV write and paged attention out of the model's
arguments, which is what lets `torch.compile` see the rest of the model as one graph: the
attention is an opaque custom op (paged_attention_op.py) that finds its caches here, as
vLLM's forward context does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from aioserve.kernels.decode_gathered_traced import GatheredBlocks
from aioserve.kernels.decode_in_pool_traced import RowsInPool
from aioserve.kernels.lora import LoRATokenGroups
from aioserve.models.attention_metadata import AttentionMetadata


class KVCache(tuple):
    """One layer's (key cache, value cache), unpacked as a pair, and the scales of an fp8
    cache: its stored values times `k_scale` (`v_scale`) are the keys (values). The scales
    are 1-element float32 tensors, never Python floats, so that every layer runs the same
    code with its own data (a compiled graph would specialize on a float); None for a cache
    in the model's dtype. `scales_pending`: the scales are still to be computed from the
    first step that writes this cache (--calculate-kv-scales, paged_attention_op.py)."""

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scales_pending: bool

    def __new__(
        cls,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        scales_pending: bool = False,
    ) -> KVCache:
        pair = super().__new__(cls, (key_cache, value_cache))
        pair.k_scale, pair.v_scale, pair.scales_pending = k_scale, v_scale, scales_pending
        return pair


@dataclass
class StepContext:
    meta: AttentionMetadata
    kv_caches: list[KVCache]  # one (key cache, value cache) per layer, with its scales
    # Set inside the graph of a step compiled whole (runner/one_row_step.py), before its
    # layers: their attention is then traced into the graph, the pool weighed in place
    # (RowsInPool) or its blocks gathered (float32 on AVX-512, GatheredBlocks), not called as
    # the custom op.
    traced_decode: RowsInPool | GatheredBlocks | None = None
    lora: LoRATokenGroups | None = None  # the step's tokens by LoRA slot; None: no adapter


_current: StepContext | None = None


@contextmanager
def step_context(
    meta: AttentionMetadata, kv_caches: list[KVCache], lora: LoRATokenGroups | None = None
) -> Iterator[StepContext]:
    """Make `meta`, `kv_caches` (and the tokens' LoRA slots) the current step's for the
    duration of a forward pass."""
    global _current
    previous, _current = _current, StepContext(meta, kv_caches, lora=lora)
    try:
        yield _current
    finally:
        _current = previous


def current_step() -> StepContext:
    if _current is None:
        raise RuntimeError("no step is running: call the model inside step_context(...)")
    return _current


def current_lora_groups() -> LoRATokenGroups | None:
    """The running step's tokens grouped by LoRA slot; None outside a step or without LoRA."""
    return None if _current is None else _current.lora
