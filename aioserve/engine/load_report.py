"""What a loaded engine holds and what it costs: the figures of the server's ready line.

`build_load_report` reads them off the loaded objects themselves once the engine is built:
the checkpoint's stored tensor types and sizes (from its headers), the bytes of the model's
parameters and buffers in the dtype they are held in, with the narrow copies that one-row
products read (models/linear.py `keep_row_weights`) counted apart, the bytes, blocks and
block size of the runner's KV tensors, and the knob that sized the KV pool. The result is
plain data (`LoadReport`) that the server reads from the engine's settings; the process's
resident memory is read when it is asked for (`resident_memory_bytes`), as it grows until
the server is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aioserve.config.arguments import CPU_KVCACHE_SPACE_ENV, DEFAULT_CPU_KVCACHE_SPACE_GIB
from aioserve.config.engine import CacheConfig
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.linear import INT4_MAX_ROWS
from aioserve.runner.kv_memory import KV_CACHE_DTYPE_NAMES
from aioserve.runner.model_runner import ModelRunner

# Buffers under these names are copies of weights kept for one-row products
# (Linear.row_weight and LlamaForCausalLM.head_row_weight), not weights of their own.
_ROW_COPY_SUFFIX = "row_weight"
# Buffers under these names hold weights in oneDNN's packed layout (models/linear.py
# `pack_weights`): a Linear's in place of its released plain weight (counted by the
# parameter's shape), the tied output head's as a copy of the embedding table.
_PACKED_SUFFIX = "packed_weight"
_PACKED_COPY_NAME = "head_packed_weight"
# Buffers under these names hold a GGUF checkpoint's 4-bit weights as stored, beside the
# float ones, for steps of a few rows (models/gguf_weights.py).
_INT4_SUFFIXES = ("int4_weight", "int4_scales_and_zeros")
# On a GPU, a GGUF checkpoint's blocks (Q4_0 ... Q6_K) in place of a Linear's released
# float weight.
_BLOCKS_SUFFIX = "gguf_blocks"
# On a GPU, an AWQ / GPTQ checkpoint's 4-bit weights in place of a Linear's released float
# weight (models/int4_group_weights.py); the first names the Linear once.
_QUANT_SUFFIXES = ("quant_qweight", "quant_scales", "quant_zeros", "quant_perm")
# On a GPU, FP8 weights and their scales in place of a Linear's float weight
# (models/fp8_weights.py); the first names the Linear once.
_FP8_SUFFIXES = ("fp8_weight", "fp8_scale")
# An INT8 layer's weights and scales, held instead of its weight (models/int8_weights.py).
_INT8_SUFFIXES = ("int8_weight", "int8_scale")
_STORED_FORMATS = {"gguf": "GGUF", "safetensors": "safetensors", "pt": "PyTorch"}

if TYPE_CHECKING:
    from aioserve.runner.pooling_runner import PoolingRunner


@dataclass(frozen=True)
class LoadReport:
    """The model as loaded and the memory it holds, measured on the loaded tensors."""

    model: str
    load_format: str
    """What the weights were read from: "gguf", "safetensors", "pt" or "dummy"."""
    stored_types: tuple[tuple[str, int], ...]
    """(stored type, bytes on disk), largest first: GGUF types (Q4_1, ...) or dtypes."""
    dtype: str
    """The dtype the weights are held in."""
    weight_bytes: int
    """The model's parameters and buffers, the row copies and kept blocks left out."""
    kept_blocks_bytes: int
    """The quantized layers' GGUF blocks, AWQ / GPTQ tensors or FP8 weights, kept as stored
    in place of float weights (a GPU)."""
    row_copy_dtype: str | None
    row_copy_bytes: int
    packed: bool
    """Whether the dense layers' weights are held in oneDNN's packed layout."""
    packed_copy_bytes: int
    """The tied output head's packed copy of the embedding table."""
    int4_bytes: int
    """The 4-bit weights kept as stored for steps of up to `int4_max_rows` rows."""
    int4_max_rows: int
    kv_cache_dtype: str
    kv_cache_bytes: int
    num_blocks: int
    block_size: int
    kv_cache_sized_by: str
    """The knob that sized the KV pool, with its value."""
    quantization: str | None = None
    """An AWQ / GPTQ / FP8 / INT8 folder's quantization in words ("AWQ 4-bit, groups of 128")."""

    def describe(self) -> str:
        """One line: the model, its weights' form and bytes, the KV cache and its knob."""
        stored = " + ".join(name for name, _ in self.stored_types)
        on_disk = format_bytes(sum(size for _, size in self.stored_types))
        if self.load_format == "dummy":
            weights = f"random weights (--load-format dummy) in {self.dtype}"
        elif self.load_format == "gguf" and self.kept_blocks_bytes:
            weights = (
                f"GGUF {stored} weights ({on_disk} on disk), the quantized layers kept as stored "
                f"({format_bytes(self.kept_blocks_bytes)}), the rest dequantized to {self.dtype}"
            )
        elif self.load_format == "gguf":
            weights = f"GGUF {stored} weights ({on_disk} on disk) dequantized to {self.dtype}"
        elif self.quantization and self.kept_blocks_bytes:
            weights = (
                f"{self.quantization} weights ({stored}, {on_disk} on disk), the quantized "
                f"layers kept as stored ({format_bytes(self.kept_blocks_bytes)}), the rest "
                f"held in {self.dtype}"
            )
        elif self.quantization:
            weights = (
                f"{self.quantization} weights ({stored}, {on_disk} on disk) dequantized to "
                f"{self.dtype}"
            )
        else:
            form = _STORED_FORMATS.get(self.load_format, self.load_format)
            weights = f"{form} {stored} weights ({on_disk} on disk) held in {self.dtype}"
        weights += f": {format_bytes(self.weight_bytes)}"
        if self.packed:
            weights += ", the dense layers' packed for oneDNN"
        if self.packed_copy_bytes:
            weights += f", plus {format_bytes(self.packed_copy_bytes)} of the head's packed copy"
        if self.int4_bytes:
            weights += (
                f", plus {format_bytes(self.int4_bytes)} of the 4-bit layers as stored, for "
                f"steps of up to {self.int4_max_rows} rows"
            )
        if self.row_copy_bytes:
            weights += (
                f", plus {format_bytes(self.row_copy_bytes)} of {self.row_copy_dtype} copies "
                "for one-row products"
            )
        if not self.num_blocks:
            return f"{self.model}, {weights}; no KV cache (an encoder-only model)"
        kv_cache = (
            f"KV cache {format_bytes(self.kv_cache_bytes)} ({self.kv_cache_dtype}, "
            f"{self.num_blocks} blocks of {self.block_size} tokens), "
            f"set by {self.kv_cache_sized_by}"
        )
        return f"{self.model}, {weights}; {kv_cache}"


def build_load_report(
    model_name: str,
    checkpoint: Checkpoint,
    runner: ModelRunner | PoolingRunner,
    kv_cache_sized_by: str,
) -> LoadReport:
    """The report of `runner`'s model and KV cache, loaded from `checkpoint`."""
    model = runner.model
    weight_bytes = sum(p.nbytes for p in model.parameters())
    held = {p.dtype for p in model.parameters()}
    row_copy_bytes = 0
    row_copy_dtypes: set[torch.dtype] = set()
    packed, packed_copy_bytes, int4_bytes, kept_blocks_bytes = False, 0, 0, 0
    for name, buffer in model.named_buffers():
        if name.endswith(_ROW_COPY_SUFFIX):
            row_copy_bytes += buffer.nbytes
            row_copy_dtypes.add(buffer.dtype)
        elif name == _PACKED_COPY_NAME:
            packed_copy_bytes += buffer.nbytes
        elif name.endswith(_PACKED_SUFFIX):
            packed = True
        elif name.endswith(_INT4_SUFFIXES):
            int4_bytes += buffer.nbytes
        elif name.endswith((_BLOCKS_SUFFIX, *_QUANT_SUFFIXES, *_FP8_SUFFIXES, *_INT8_SUFFIXES)):
            kept_blocks_bytes += buffer.nbytes
            if not name.endswith((*_QUANT_SUFFIXES[1:], *_FP8_SUFFIXES[1:], *_INT8_SUFFIXES[1:])):
                # the Linear's weight parameter is only a shape now
                weight_bytes -= model.get_submodule(name.rpartition(".")[0]).weight.nbytes
        else:
            weight_bytes += buffer.nbytes
    kv_tensors = [t for pair in runner.kv_caches for t in pair]
    num_blocks, block_size = kv_tensors[0].shape[:2] if kv_tensors else (0, 0)
    return LoadReport(
        model=model_name,
        load_format=checkpoint.load_format,
        stored_types=tuple(checkpoint.stored_weight_types().items()),
        dtype=_dtype_names(held),
        weight_bytes=weight_bytes,
        kept_blocks_bytes=kept_blocks_bytes,
        row_copy_dtype=_dtype_names(row_copy_dtypes) if row_copy_dtypes else None,
        row_copy_bytes=row_copy_bytes,
        packed=packed,
        packed_copy_bytes=packed_copy_bytes,
        int4_bytes=int4_bytes,
        int4_max_rows=INT4_MAX_ROWS,
        kv_cache_dtype=_kv_dtype_names({t.dtype for t in kv_tensors}),
        kv_cache_bytes=sum(t.nbytes for t in kv_tensors),
        num_blocks=int(num_blocks),
        block_size=int(block_size),
        kv_cache_sized_by=kv_cache_sized_by,
        quantization=_quantization(checkpoint),
    )


def kv_cache_sized_by(cache: CacheConfig, platform: str) -> str:
    """The knob that sizes the KV pool (kv_memory.num_kv_blocks's order), with its value."""
    if cache.num_gpu_blocks_override is not None:
        return f"--num-gpu-blocks-override {cache.num_gpu_blocks_override}"
    if cache.kv_cache_memory_bytes is not None and (
        platform != "cpu" or cache.cpu_kvcache_space_bytes == cache.kv_cache_memory_bytes
    ):
        return f"--kv-cache-memory-bytes ({format_bytes(cache.kv_cache_memory_bytes)})"
    if platform == "cpu":
        gib = cache.cpu_kvcache_space_bytes / 2**30
        default = gib == DEFAULT_CPU_KVCACHE_SPACE_GIB
        return f"{CPU_KVCACHE_SPACE_ENV} ({gib:g} GiB{', the default' if default else ''})"
    return f"--gpu-memory-utilization {cache.gpu_memory_utilization:g}"


def resident_memory_bytes() -> int | None:
    """The process's resident set size now (VmRSS of /proc/self/status), or None without
    /proc. (resource.getrusage gives only the peak, and psutil is no dependency.)"""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return None


def format_bytes(size: int) -> str:
    """`size` in GiB with two decimals from 1 GiB up, else in MiB or KiB."""
    if size >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{size} B"


def _quantization(checkpoint: Checkpoint) -> str | None:
    """A quantized folder's scheme in words, or what --quantization fp8 made of one."""
    scheme = checkpoint.int4_scheme or checkpoint.fp8_scheme or checkpoint.int8_scheme
    if scheme is not None:
        return scheme.describe()
    if checkpoint.quantize_to_fp8:
        return "FP8 W8A8 quantized at load (e4m3, a scale a row, activations scaled per row)"
    return None


def _kv_dtype_names(dtypes: set[torch.dtype]) -> str:
    """The KV pool's dtype: an fp8 one by its --kv-cache-dtype name ("fp8_e4m3")."""
    return "/".join(sorted(KV_CACHE_DTYPE_NAMES.get(d) or _dtype_names({d}) for d in dtypes))


def _dtype_names(dtypes: set[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
