"""Build a model from an opened checkpoint and fill its weights."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from tqdm import tqdm

from aioserve.models.checkpoint import Checkpoint
from aioserve.models.registry import model_class_for
from aioserve.models.transformers_backend import TransformersForCausalLM

logger = logging.getLogger("aioserve")


def load_model(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool = False,
    seed: int = 0,
    use_tqdm: bool = True,
    model_impl: str = "auto",
) -> nn.Module:
    """The checkpoint's model on `device` in `dtype`, in eval mode, by the implementation
    --model-impl `model_impl` picks (models/registry.py).

    With `dummy`, parameters get small random values instead of the checkpoint's
    (vLLM's `--load-format dummy`: for measuring shapes whose weights are not at hand).
    """
    model_class = model_class_for(checkpoint.hf_config, model_impl)
    if model_class is TransformersForCausalLM:
        _check_transformers_backend(checkpoint)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(checkpoint.hf_config)
    finally:
        torch.set_default_dtype(previous_dtype)
    if dummy:
        _fill_dummy(model, seed)
    else:
        _load_checkpoint_weights(model, checkpoint, use_tqdm)
    return model.eval().requires_grad_(False)


def _check_transformers_backend(checkpoint: Checkpoint) -> None:
    """The Transformers backend reads plain weights only: aioserve's quantized layers are
    its own models' (the checkpoint would be dequantized, then kept as stored by code
    that knows only those)."""
    quantized = (
        "a GGUF file"
        if checkpoint.load_format == "gguf"
        else "an AWQ/GPTQ checkpoint"
        if checkpoint.int4_scheme is not None
        else "an FP8 checkpoint"
        if checkpoint.fp8_scheme is not None or checkpoint.quantize_to_fp8
        else "an INT8 checkpoint"
        if checkpoint.int8_scheme is not None
        else None
    )
    if quantized is not None:
        raise ValueError(
            f"the Transformers backend (--model-impl) does not serve {quantized} yet: "
            "only plain safetensors or PyTorch weights"
        )


def _load_checkpoint_weights(model: nn.Module, checkpoint: Checkpoint, use_tqdm: bool) -> None:
    started = time.monotonic()
    weights = checkpoint.weights()
    if use_tqdm:
        # Drawn on a terminal only (disable=None) and cleared when done: a log file or the
        # journal gets the line below instead of a run of carriage-return updates.
        weights = tqdm(
            weights,
            total=checkpoint.num_weight_tensors(),
            desc="Loading weights",
            unit="tensor",
            leave=False,
            disable=None,
        )
    loaded = model.load_weights(weights)
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors: {shown}")
    logger.info(
        "loaded %d checkpoint tensors into %d parameters in %.1f s",
        checkpoint.num_weight_tensors(),
        len(loaded),
        time.monotonic() - started,
    )


def _fill_dummy(model: nn.Module, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(
                -1e-3, 1e-3, generator=generator
            )
            param.copy_(values)
