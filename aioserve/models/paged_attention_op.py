"""One layer's KV-cache write and paged attention, as a torch custom op.

`torch.compile` treats a custom op as opaque: it neither traces into the attention (whose
plan is a Python object that changes every step) nor sees the KV caches, which the op finds
in the step context (step_context.py). So the whole model compiles as one graph with the
token count dynamic, and the attention runs as it does eagerly, through
`aioserve.kernels`. Eagerly, the op's Python body is called directly, skipping the
dispatcher. The layer's KV caches, and an fp8 cache's scales, come from the step context
by `layer_index`, so that one compiled graph serves every layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.attention import paged_attention
from aioserve.kernels.kv_cache import write_kv_cache
from aioserve.models.step_context import current_step


def _attend(query: Tensor, key: Tensor, value: Tensor, layer_index: int, scale: float) -> Tensor:
    step = current_step()
    meta = step.meta
    layer_cache = step.kv_caches[layer_index]
    key_cache, value_cache = layer_cache
    # An fp8 cache's scales (KVCache); a plain pair has none.
    k_scale = getattr(layer_cache, "k_scale", None)
    v_scale = getattr(layer_cache, "v_scale", None)
    write_kv_cache(
        key,
        value,
        key_cache,
        value_cache,
        meta.slot_mapping,
        meta.skips_kv_writes,
        k_scale,
        v_scale,
    )
    return paged_attention(
        query,
        key_cache,
        value_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        meta.max_query_len,
        meta.max_seq_len,
        plan=meta.plan,
        k_scale=k_scale,
        v_scale=v_scale,
    )


@torch.library.custom_op("aioserve::paged_attention", mutates_args=())
def _paged_attention_op(
    query: Tensor, key: Tensor, value: Tensor, layer_index: int, scale: float
) -> Tensor:
    return _attend(query, key, value, layer_index, scale)


@_paged_attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, layer_index: int, scale: float) -> Tensor:
    return torch.empty_like(query)


def attend_layer(
    query: Tensor, key: Tensor, value: Tensor, layer_index: int, scale: float
) -> Tensor:
    """Write this layer's new keys and values into its cache, then attend: [T, Hq, D]."""
    if torch.compiler.is_compiling():
        # Contiguous in and out, so that the op's inputs have one layout whatever inductor
        # decided for the views that feed it.
        return _paged_attention_op(
            query.contiguous(), key.contiguous(), value.contiguous(), layer_index, scale
        )
    return _attend(query, key, value, layer_index, scale)
