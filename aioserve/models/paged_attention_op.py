"""One layer's KV-cache write and paged attention, as a torch custom op.

`torch.compile` treats a custom op as opaque: it neither traces into the attention (whose
plan is a Python object that changes every step) nor sees the KV caches, which the op finds
in the step context (step_context.py). So the whole model compiles as one graph with the
token count dynamic, and the attention runs as it does eagerly, through
`aioserve.kernels`. Eagerly, the op's Python body is called directly, skipping the
dispatcher. The layer's KV caches, and an fp8 cache's scales, come from the step context
by `layer_index`, so that one compiled graph serves every layer.

With --calculate-kv-scales (vLLM's meaning) an fp8 cache's scales are computed from the
keys and values of the first step that writes it, as vLLM computes them:
k_scale = max |key| / 200 and v_scale = max |value| / 100, then kept for good. Steps that
write no slot (compile and memory-profiling warm-ups) and CUDA/HIP graph captures leave
them pending.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.attention import paged_attention
from aioserve.kernels.decode_gathered_traced import write_and_attend_gathered
from aioserve.kernels.decode_in_pool_traced import RowsInPool, write_and_attend
from aioserve.kernels.kv_cache import write_kv_cache
from aioserve.kernels.rotary import apply_rotary
from aioserve.kernels.rotary_kv_write import rotary_and_write_kv_triton
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import KVCache, current_step

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: the computed scale maps the largest key
# (value) of the first step to 200 (100), well inside e4m3's 448.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layer_index: int,
    scale: float,
    sliding_window: int = 0,
    kv_written: bool = False,
) -> Tensor:
    step = current_step()
    meta = step.meta
    layer_cache = step.kv_caches[layer_index]
    key_cache, value_cache = layer_cache
    # An fp8 cache's scales (KVCache); a plain pair has none.
    k_scale = getattr(layer_cache, "k_scale", None)
    v_scale = getattr(layer_cache, "v_scale", None)
    if not kv_written:
        if getattr(layer_cache, "scales_pending", False) and _writes_kv(meta):
            written = meta.slot_mapping >= 0
            _calculate_scales(layer_cache, key[written], value[written])
        write_kv_cache(
            key,
            value,
            key_cache,
            value_cache,
            meta.slot_mapping,
            meta.skips_kv_writes,
            k_scale,
            v_scale,
            None if meta.plan is None else meta.plan.write_index,
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
        new_kv=(key, value),
        sliding_window=sliding_window,
    )


def _writes_kv(meta: AttentionMetadata) -> bool:
    """Whether the step writes a KV slot and is not being captured into a graph. (A host
    sync on a GPU: asked only while a layer's scales are pending.)"""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return bool((meta.slot_mapping >= 0).any())


def _calculate_scales(layer_cache: KVCache, key: Tensor, value: Tensor) -> None:
    """The layer's scales from the keys and values this step writes (a zero one kept
    positive)."""
    tiny = torch.finfo(torch.float32).tiny
    layer_cache.k_scale.copy_((key.abs().amax().float() / K_SCALE_RANGE).clamp_min(tiny))
    layer_cache.v_scale.copy_((value.abs().amax().float() / V_SCALE_RANGE).clamp_min(tiny))
    layer_cache.scales_pending = False


# Registered through torch.library.Library rather than custom_op, as models/linear.py's
# packed_dense is: the compiled step calls it once a layer, and custom_op's Python layers
# cost ~5 us more a call on a Zen 5 EPYC. The layer's index is a SymInt: as a plain int,
# dynamo would guard on its value and compile a graph for every layer. The sliding window
# is a plain int: a model's layers have at most two (Gemma 3's local and global layers),
# so at most two graphs.
_LIBRARY = torch.library.Library("aioserve", "FRAGMENT")
_LIBRARY.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, SymInt layer_index, float scale, "
    "int sliding_window=0) -> Tensor"
)
_LIBRARY.impl("paged_attention", _attend, "CompositeExplicitAutograd")


@torch.library.register_fake("aioserve::paged_attention")
def _(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layer_index: int,
    scale: float,
    sliding_window: int = 0,
) -> Tensor:
    return torch.empty_like(query)


def rotate_and_attend(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
    layer_index: int,
    scale: float,
    sliding_window: int = 0,
) -> Tensor:
    """Rotate query [T, Hq, D] and key [T, Hkv, D], write this layer's keys and values into
    its cache, then attend: [T, Hq, D], each row over the last `sliding_window` positions
    through its own when that is not 0 (kernels/attention.py).

    Where the Triton kernels run eagerly (a GPU) the rotary and the write are one launch
    (kernels/rotary_kv_write.py), unless the layer's fp8 scales are still to be computed
    from the rotated keys; elsewhere `apply_rotary`, then `attend_layer`."""
    if dispatch.use_triton() and not torch.compiler.is_compiling():
        step = current_step()
        layer_cache = step.kv_caches[layer_index]
        if not getattr(layer_cache, "scales_pending", False):
            key_cache, value_cache = layer_cache
            query, key = rotary_and_write_kv_triton(
                positions,
                query,
                key,
                value,
                cos_sin_cache,
                key_cache,
                value_cache,
                step.meta.slot_mapping,
                is_neox_style,
                getattr(layer_cache, "k_scale", None),
                getattr(layer_cache, "v_scale", None),
            )
            return _attend(query, key, value, layer_index, scale, sliding_window, kv_written=True)
    query, key = apply_rotary(positions, query, key, cos_sin_cache, is_neox_style)
    return attend_layer(query, key, value, layer_index, scale, sliding_window)


def attend_layer(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layer_index: int,
    scale: float,
    sliding_window: int = 0,
) -> Tensor:
    """Write this layer's new keys and values into its cache, then attend: [T, Hq, D]."""
    if torch.compiler.is_compiling() and not isinstance(layer_index, torch.SymInt):
        # The step compiled whole (its layers' indices constants): its attention is torch
        # ops in the graph.
        step = current_step()
        traced = step.traced_decode
        if traced is not None:
            key_cache, value_cache = step.kv_caches[layer_index]
            attend = (
                write_and_attend if isinstance(traced, RowsInPool) else write_and_attend_gathered
            )
            return attend(query, key, value, key_cache, value_cache, traced, scale, sliding_window)
    if torch.compiler.is_compiling():
        # Contiguous in and out, so that the op's inputs have one layout whatever inductor
        # decided for the views that feed it.
        return torch.ops.aioserve.paged_attention(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            layer_index,
            scale,
            sliding_window,
        )
    return _attend(query, key, value, layer_index, scale, sliding_window)
