"""How much device memory the paged KV cache gets, and its shape.

On the CPU the pool is VLLM_CPU_KVCACHE_SPACE (vLLM's variable); on a GPU it is what
`--gpu-memory-utilization` of the device leaves after the weights and the activations of
the largest step, measured by running one (`profile_peak_step`).
`--num-gpu-blocks-override` overrides both. `allocate_kv_caches` then makes the pool.

`--kv-cache-dtype` picks the pool's dtype (`kv_cache_torch_dtype`): the model's (auto) or
an fp8 format of one byte an element, so that the same memory holds twice the blocks of a
16-bit cache. An fp8 cache's values are scaled per layer (kernels/kv_cache.py): by the
checkpoint's `k_scale`/`v_scale` when it has them (the model's `kv_scales`), else 1.0,
or, with --calculate-kv-scales, computed from the first step (models/paged_attention_op.py).
"""

from __future__ import annotations

import itertools
import threading

import torch
from torch import nn

from aioserve import host_memory
from aioserve.kernels import dispatch
from aioserve.kernels.kv_cache import empty_kv_cache, is_fp8, torch_path_layouts
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import KVCache, step_context
from aioserve.platform import current_platform, e4m3_dtype, e4m3_missing

# --kv-cache-dtype values and the names the load report gives the pool's dtype.
KV_CACHE_DTYPE_NAMES = {
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e4m3fnuz: "fp8_e4m3 (fnuz)",
    torch.float8_e5m2: "fp8_e5m2",
}


def kv_cache_torch_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype `requested` (vLLM's names; fp8 is fp8_e4m3).

    e4m3 is float8_e4m3fn, except on ROCm's MI300 family (gfx94x), whose hardware format is
    float8_e4m3fnuz (platform.e4m3_dtype); refused on a GPU that has no e4m3 at all.
    """
    if requested == "auto":
        return model_dtype
    if requested == "fp8_e5m2":
        return torch.float8_e5m2
    if requested in ("fp8", "fp8_e4m3"):
        missing = e4m3_missing()
        if missing is not None:
            raise ValueError(
                f"--kv-cache-dtype {requested} (e4m3) cannot run here: {missing}; "
                "use --kv-cache-dtype fp8_e5m2 or auto"
            )
        return e4m3_dtype()
    raise ValueError(f"KV-cache dtype {requested!r} is not supported")


def layer_kv_scales(model: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """[layers, 2] float32: each layer's (k_scale, v_scale) for a cache of `dtype`, None for
    a cache that is not fp8.

    The model's `kv_scales` (1.0 unless its checkpoint gave them). A checkpoint's scales
    are for float8_e4m3fn: a float8_e4m3fnuz value is half the e4m3fn value of the same
    bits, so they double there (as vLLM does).
    """
    if not is_fp8(dtype):
        return None
    scales = getattr(model, "kv_scales", None)
    if scales is None:
        raise ValueError(f"{type(model).__name__} has no KV-cache scales for an fp8 KV cache")
    if dtype == torch.float8_e4m3fnuz and getattr(model, "kv_scales_loaded", False):
        return scales * 2
    return scales


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_caches(
    config,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    scales: torch.Tensor | None = None,
    calculate_scales: bool = False,
) -> tuple[list[KVCache], KVZeroing | None]:
    """One (key cache, value cache) pair per layer, zeroed, and on the CPU the `KVZeroing`
    under way.

    An fp8 pool's pairs carry their layer's row of `scales` [layers, 2] (1.0 when None), or
    with `calculate_scales` scales to be computed from the first step that writes them.

    Zeros, not whatever memory held: attention reads the unwritten tail of a sequence's
    last block and masks it, and a NaN there would survive the mask (0 × NaN). And every
    page written before the server says it is ready, so that a pool the machine cannot hold
    fails at start, not under load. On the CPU that first touch of every page takes over a
    second for the default 4 GiB, so a thread does it beside the compile (torch releases
    the GIL while it fills); join it before a step reads the caches.
    """
    shape = kv_cache_shape(config, num_blocks, block_size)
    num_layers = config.num_hidden_layers
    if calculate_scales and not is_fp8(dtype):
        raise ValueError("--calculate-kv-scales needs an fp8 --kv-cache-dtype")
    if is_fp8(dtype) and (scales is None or calculate_scales):
        scales = torch.ones((num_layers, 2), dtype=torch.float32)
    if scales is not None:
        scales = scales.to(device=device, dtype=torch.float32).contiguous()
    # Where the torch path attends, the layouts it reads in place (kv_cache.py); the Triton
    # kernels read a slot-major pool.
    key_layout, value_layout = (
        torch_path_layouts(dtype) if not dispatch.use_triton() else ("slot_major", "slot_major")
    )
    caches = [
        KVCache(
            empty_kv_cache(*shape, dtype, device, key_layout),
            empty_kv_cache(*shape, dtype, device, value_layout),
            *((scales[i, 0:1], scales[i, 1:2], calculate_scales) if scales is not None else ()),
        )
        for i in range(num_layers)
    ]
    if device.type != "cpu":
        with torch.inference_mode():
            for key, value in caches:
                key.zero_()
                value.zero_()
        return caches, None
    return caches, KVZeroing([cache for pair in caches for cache in pair])


class KVZeroing:
    """Zeroes the CPU pool's caches on a thread of its own, one core, beside the compile;
    `join` zeroes what is left on the calling thread too, with all of its cores, and
    returns once every cache is zeroed."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self._caches = caches
        # Huge pages made the first touch 5x slower under KVM, for 1-2% of long-context
        # throughput (host_memory.py).
        for cache in caches:
            host_memory.on_small_pages(cache.data_ptr(), cache.untyped_storage().nbytes())
        self._next = itertools.count()  # the caches are taken in turn, by either thread
        self._thread = threading.Thread(target=self._zero_on_one_core, name="kv-zeroing")
        self._thread.daemon = True
        self._thread.start()

    def join(self) -> None:
        self._zero_the_rest()
        self._thread.join()

    def _zero_on_one_core(self) -> None:
        # One core: compiling, in the other thread, runs on one core and leaves the other
        # free. torch's thread count is per thread, but set_num_threads also sets the count
        # a thread starts with when it first uses torch: set back once done, or the next
        # engine built in this process stepped its model on one core.
        cores = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._zero_the_rest()
        finally:
            torch.set_num_threads(cores)

    def _zero_the_rest(self) -> None:
        with torch.inference_mode():
            for i in self._next:
                if i >= len(self._caches):
                    return
                self._caches[i].zero_()


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    _, _, num_kv_heads, head_dim = kv_cache_shape(config, 1, block_size)
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim * element_size


def profile_peak_step(
    model: nn.Module, max_num_batched_tokens: int, max_logits_rows: int, dtype: torch.dtype
) -> int:
    """Bytes a step of max_num_batched_tokens tokens needs beyond the weights (GPU only), with
    a KV cache of `dtype`; its logits for `max_logits_rows` rows (a step's sequences, or with
    speculative decoding, each sequence's drafts' positions too)."""
    dev = next(model.parameters()).device
    kv, _ = allocate_kv_caches(model.config, 1, 1, dtype, dev)
    tokens = max_num_batched_tokens
    meta = AttentionMetadata.without_kv_writes(tokens, dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode(), step_context(meta, kv):
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        hidden = model(ids, torch.zeros_like(ids))
        model.compute_logits(hidden[: min(max_logits_rows, tokens)])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del kv, hidden
    torch.cuda.empty_cache()
    return peak


def num_kv_blocks(
    model: nn.Module,
    *,
    block_size: int,
    dtype: torch.dtype,
    num_blocks_override: int | None,
    cpu_kvcache_space_bytes: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_logits_rows: int,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """The number of KV blocks of `dtype` the device can hold for `model` (on a GPU in
    `kv_cache_memory_bytes` when given, else in what `gpu_memory_utilization` leaves)."""
    if num_blocks_override is not None:
        return num_blocks_override
    per_block = kv_cache_bytes_per_block(model.config, block_size, dtype)
    if current_platform() == "cpu":
        return max(1, cpu_kvcache_space_bytes // per_block)
    free, total = torch.cuda.mem_get_info()
    peak_step_bytes = profile_peak_step(model, max_num_batched_tokens, max_logits_rows, dtype)
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes > free - peak_step_bytes:
            raise ValueError(
                f"--kv-cache-memory-bytes {kv_cache_memory_bytes} does not fit: "
                f"{free / 2**30:.2f} GiB are free, and a step's activations take "
                f"{peak_step_bytes / 2**30:.2f} GiB of them"
            )
        return max(1, kv_cache_memory_bytes // per_block)
    in_use = total - free
    budget = int(total * gpu_memory_utilization) - in_use - peak_step_bytes
    if budget < per_block:
        raise ValueError(
            f"no memory left for the KV cache: --gpu-memory-utilization "
            f"{gpu_memory_utilization} of {total / 2**30:.1f} GiB is taken by the weights "
            f"({in_use / 2**30:.1f} GiB in use) and a step's activations"
        )
    return budget // per_block
