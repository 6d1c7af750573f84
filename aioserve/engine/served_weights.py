"""The model as served: built and filled from its checkpoint by the implementation
--model-impl picks (models/loader.py), then, where the device reads them so, its quantized
layers kept as stored (GGUF blocks, AWQ/GPTQ 4-bit, FP8, INT8) or its layers quantized at
load (--quantization fp8). `build_engine` calls `load_served_model` once, and a level-2
wake from sleep again (engine/sleep.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from aioserve.config.engine import EngineConfig
from aioserve.engine.resolution import resolve_packed_weights
from aioserve.kernels.int8_linear_reference import int8_gemm_exact
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.fp8_weights import keep_fp8_weights, quantize_to_fp8
from aioserve.models.gguf_weights import keep_gguf_blocks, keep_int4_weights
from aioserve.models.int4_group_weights import keep_int4_cpu_weights, keep_int4_group_weights
from aioserve.models.int8_weights import keep_int8_weights
from aioserve.models.linear import INT4_MAX_ROWS
from aioserve.models.loader import load_model
from aioserve.models.moe import num_experts
from aioserve.models.moe_fp8_weights import keep_fp8_experts
from aioserve.platform import e4m3_dtype, e4m3_missing, is_gpu

logger = logging.getLogger("aioserve")


def resolve_gguf_blocks(checkpoint: Checkpoint) -> bool:
    """Whether a GGUF checkpoint's quantized layers (Q4_0 ... Q6_K) hold only their blocks,
    read as stored by the Triton kernels (models/gguf_weights.py): on a GPU."""
    return checkpoint.load_format == "gguf" and is_gpu()


def resolve_int4_weights(checkpoint: Checkpoint, dtype: torch.dtype) -> bool:
    """Whether small steps read a GGUF, AWQ or GPTQ checkpoint's 4-bit weights as stored
    (models/gguf_weights.py, models/int4_group_weights.py): where the dense products run on
    packed bfloat16 weights, beside which torch's int4 CPU op serves steps of a few rows."""
    quantized = checkpoint.load_format == "gguf" or checkpoint.int4_scheme is not None
    return quantized and resolve_packed_weights(dtype)


def resolve_int4_group_weights(checkpoint: Checkpoint) -> bool:
    """Whether an AWQ or GPTQ checkpoint's layers hold only their 4-bit weights, read as
    stored by the Triton kernels (models/int4_group_weights.py): on a GPU. The CPU computes
    on the weights dequantized at load."""
    return checkpoint.int4_scheme is not None and is_gpu()


def resolve_fp8_weights(checkpoint: Checkpoint) -> bool:
    """Whether an FP8 checkpoint's layers hold only their 8-bit weights, read as stored by
    the Triton kernels (models/fp8_weights.py): on a GPU that has e4m3 floats. The CPU, and
    an NVIDIA GPU before sm_89, compute on the weights dequantized at load."""
    if checkpoint.fp8_scheme is None or not is_gpu():
        return False
    missing = e4m3_missing()
    if missing is not None:
        logger.warning("the FP8 layers are dequantized at load: %s", missing)
    return missing is None


def resolve_int8_weights(checkpoint: Checkpoint) -> bool:
    """Whether an INT8 W8A8 checkpoint's layers hold only their int8 weights
    (models/int8_weights.py): on a GPU, and on a CPU whose int8 GEMM sums exactly (VNNI or
    AMX). Elsewhere they compute on the weights dequantized at load, as FP8's do."""
    if checkpoint.int8_scheme is None:
        return False
    if is_gpu() or int8_gemm_exact():
        return True
    logger.warning(
        "the INT8 layers are dequantized at load: this CPU's int8 GEMM (oneDNN without VNNI "
        "or AMX) saturates its 16-bit pair sums, and summing exactly without it is slower "
        "than the dequantized weights"
    )
    return False


def load_served_model(
    checkpoint: Checkpoint, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The checkpoint's model in its served form, on `device` in `dtype`."""
    model_cfg = config.model
    model = load_model(
        checkpoint,
        dtype=dtype,
        device=device,
        dummy=config.load.load_format == "dummy",
        seed=model_cfg.seed,
        use_tqdm=config.load.use_tqdm_on_load,
        model_impl=model_cfg.model_impl,
    )
    if resolve_gguf_blocks(checkpoint):
        kept = keep_gguf_blocks(model, checkpoint)
        logger.info("the quantized layers are kept as stored: %.0f MiB of blocks", kept / 2**20)
    elif resolve_int4_weights(checkpoint, dtype):
        if checkpoint.int4_scheme is None:
            added = keep_int4_weights(model, checkpoint, dtype)
        else:
            added = keep_int4_cpu_weights(
                model, checkpoint.int4_group_layers(), checkpoint.int4_scheme, dtype
            )
        logger.info(
            "steps of up to %d rows read the checkpoint's 4-bit weights as stored "
            "(%.0f MiB more memory)",
            INT4_MAX_ROWS,
            added / 2**20,
        )
    elif resolve_int4_group_weights(checkpoint):
        assert checkpoint.int4_scheme is not None
        kept = keep_int4_group_weights(
            model, checkpoint.int4_group_layers(), checkpoint.int4_scheme
        )
        logger.info(
            "the %s 4-bit layers are kept as stored: %.0f MiB",
            checkpoint.int4_scheme.method.upper(),
            kept / 2**20,
        )
    elif resolve_fp8_weights(checkpoint):
        kept = keep_fp8_weights(model, checkpoint.fp8_layers(), e4m3_dtype())
        if num_experts(checkpoint.hf_config):
            kept += keep_fp8_experts(model, checkpoint.fp8_layers(), e4m3_dtype())
        logger.info("the FP8 layers are kept as stored: %.0f MiB", kept / 2**20)
    elif resolve_int8_weights(checkpoint):
        kept = keep_int8_weights(model, checkpoint.int8_layers())
        logger.info("the INT8 layers are kept as stored: %.0f MiB", kept / 2**20)
    elif checkpoint.quantize_to_fp8:
        kept = quantize_to_fp8(model, e4m3_dtype())
        logger.info(
            "--quantization fp8: the decoder layers quantized to FP8 at load, a scale a row: "
            "%.0f MiB",
            kept / 2**20,
        )
    return model
