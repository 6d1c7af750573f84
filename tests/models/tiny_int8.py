"""Tiny random-weight Llama checkpoints in INT8 W8A8, as llm-compressor's `compressed-tensors`
writes them in its `int-quantized` format.

`write_tiny_int8(folder, per_channel)` quantizes the decoder's seven projections of a random
float Llama with numpy (symmetric: scale = the row's or the tensor's largest magnitude / 127,
values rounded half to even), writes model.safetensors (`<prefix>.weight` in int8 beside
`<prefix>.weight_scale` [N, 1] or [1] in float16, and, as some versions of the tool do, an
all-zero `<prefix>.weight_zero_point`; the rest in float16, the output head left out) and
config.json with its `quantization_config` (bench/w8a8_int8_checkpoint.py's), and returns
the float32 state dict the checkpoint stands for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from bench.w8a8_int8_checkpoint import quantization_config
from tests.models.tiny_quantized import PROJECTIONS, plain_tensor, save_folder, tiny_config


def quantize(weight: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [N, K] and float16 scales ([N] or [1]) of a float32 weight [N, K]."""
    magnitudes = np.abs(weight)
    largest = magnitudes.max(axis=1) if per_channel else magnitudes.max(keepdims=True).reshape(1)
    scale = (largest / 127.0).astype(np.float16)
    values = np.clip(np.rint(weight / scale.astype(np.float32)[:, None]), -127, 127)
    return values.astype(np.int8), scale


def write_tiny_int8(
    folder: Path, per_channel: bool = True, seed: int = 0, zero_points: bool = True
) -> dict[str, torch.Tensor]:
    """Write the checkpoint into `folder`; returns the float32 state dict it stands for."""
    config = tiny_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            values, scale = quantize(param.float().numpy(), per_channel)
            prefix = name.removesuffix(".weight")
            tensors[name] = torch.from_numpy(values)
            stored = scale.reshape(-1, 1) if per_channel else scale
            tensors[f"{prefix}.weight_scale"] = torch.from_numpy(stored)
            if zero_points:
                tensors[f"{prefix}.weight_zero_point"] = torch.zeros(stored.shape, dtype=torch.int8)
            expected[name] = torch.from_numpy(
                values.astype(np.float32) * scale.astype(np.float32)[:, None]
            )
        else:
            tensors[name] = plain_tensor(name, param)
            expected[name] = tensors[name].float()
    strategy = "channel" if per_channel else "tensor"
    save_folder(folder, tensors, config, quantization_config(strategy))
    return expected
