"""Tiny random-weight Llama checkpoints in FP8 W8A8, written as vLLM's `fp8` format and
llm-compressor's `compressed-tensors` (float-quantized) write them.

`write_tiny_fp8(folder, fmt, per_channel)` quantizes the decoder's seven projections of a
random float Llama with torch's own e4m3fn cast (scale = the tensor's or the row's largest
magnitude / 448), writes model.safetensors (`<prefix>.weight` in float8_e4m3fn beside
`<prefix>.weight_scale`: a 0-d tensor for vLLM's per-tensor format, [N, 1] or [1] for
compressed-tensors' channel and tensor strategies; the rest in float16, the output head
left out of the quantization as the tools do) and config.json with its
`quantization_config`, and returns the float32 state dict the checkpoint stands for.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from tests.models.tiny_quantized import PROJECTIONS, plain_tensor, save_folder, tiny_config

E4M3_MAX = 448.0


def quantization_config(fmt: str, per_channel: bool) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": ["lm_head"],
        }
    strategy = "channel" if per_channel else "tensor"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True, "symmetric": True},
            }
        },
    }  # fmt: skip


def _quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn values and the scale(s): [N, 1] per row or a 0-d tensor."""
    largest = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = largest / E4M3_MAX
    return (weight / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_tiny_fp8(
    folder: Path, fmt: str = "fp8", per_channel: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Write the checkpoint into `folder`; returns the float32 state dict it stands for."""
    if fmt == "fp8" and per_channel:
        raise ValueError("vLLM's fp8 format has one scale a tensor")
    config = tiny_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            values, scale = _quantize(param.float(), per_channel)
            prefix = name.removesuffix(".weight")
            tensors[name] = values.contiguous()
            stored_scale = scale if fmt == "fp8" or per_channel else scale.reshape(1)
            tensors[f"{prefix}.weight_scale"] = stored_scale.float().contiguous()
            expected[name] = values.float() * scale.float()
        else:
            tensors[name] = plain_tensor(name, param)
            expected[name] = tensors[name].float()
    save_folder(folder, tensors, config, quantization_config(fmt, per_channel))
    return expected
