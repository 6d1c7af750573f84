"""Tiny random-weight Llama checkpoints in block-wise FP8, written as DeepSeek-V3's and
Qwen3's `-FP8` folders (vLLM's `fp8` with `weight_block_size`) and llm-compressor's
compressed-tensors `block` strategy write them.

`write_tiny_fp8_block(folder, fmt, block)` quantizes the decoder's seven projections of a
random float Llama block by block (`write_fp8_block_folder` those of any model's state,
a mixture-of-experts model's experts among them) with torch's own e4m3fn cast (a block's scale = its
largest magnitude / 448), written out independently of aioserve's quantizer: each block's
weights are first multiplied by a factor between 1/8 and 8 of its own, so that a scale read
from the wrong block gives visibly wrong weights. It writes model.safetensors
(`<prefix>.weight` in float8_e4m3fn beside `<prefix>.weight_scale_inv` for `fp8`,
`<prefix>.weight_scale` for compressed-tensors, float32 [⌈N / rows⌉, ⌈K / columns⌉]; the
rest in float16, the output head left out) and config.json, and returns the float32 state
dict the checkpoint stands for.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PretrainedConfig

from tests.models.tiny_quantized import PROJECTIONS, plain_tensor, save_folder, tiny_config

E4M3_MAX = 448.0
FORMATS = ("fp8", "compressed-tensors")


def quantization_config(fmt: str, block: tuple[int, int]) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                            "block_structure": list(block), "dynamic": False,
                            "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                      "group_size": block[1], "dynamic": True,
                                      "symmetric": True},
            }
        },
    }  # fmt: skip


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn values [N, K] and float32 scales [⌈N / rows⌉, ⌈K / columns⌉], a block at a
    time."""
    n, k = weight.shape
    rows, columns = block
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // rows), -(-k // columns))
    for i, r in enumerate(range(0, n, rows)):
        for j, c in enumerate(range(0, k, columns)):
            part = weight[r : r + rows, c : c + columns]
            scales[i, j] = part.abs().max() / E4M3_MAX
            values[r : r + rows, c : c + columns] = (part / scales[i, j]).to(torch.float8_e4m3fn)
    return values, scales


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The float32 weight a block at a time."""
    weight = values.float()
    rows, columns = block
    for i, r in enumerate(range(0, weight.shape[0], rows)):
        for j, c in enumerate(range(0, weight.shape[1], columns)):
            weight[r : r + rows, c : c + columns] *= scales[i, j]
    return weight


def _uneven_blocks(weight: torch.Tensor, block: tuple[int, int], seed: int) -> torch.Tensor:
    """`weight` with each block times its own factor in [1/8, 8]."""
    generator = torch.Generator().manual_seed(seed)
    rows, columns = block
    factors = 2.0 ** torch.empty(
        -(-weight.shape[0] // rows), -(-weight.shape[1] // columns)
    ).uniform_(-3, 3, generator=generator)
    spread = factors.repeat_interleave(rows, 0).repeat_interleave(columns, 1)
    return weight * spread[: weight.shape[0], : weight.shape[1]]


def write_fp8_block_folder(
    folder: Path,
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    fmt: str = "fp8",
    block: tuple[int, int] = (128, 128),
) -> dict[str, torch.Tensor]:
    """Write the checkpoint of `state` (a model's tensors as a checkpoint names them: one
    per expert) into `folder`, every decoder projection (an expert's too, not the router)
    quantized; returns the float32 state dict it stands for."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}")
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for index, (name, param) in enumerate(state.items()):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            values, scales = quantize_blocks(_uneven_blocks(param.float(), block, index), block)
            tensors[name] = values
            tensors[f"{name.removesuffix('.weight')}.{scale_name}"] = scales
            expected[name] = dequantize_blocks(values, scales, block)
        else:
            tensors[name] = plain_tensor(name, param)
            expected[name] = tensors[name].float()
    save_folder(folder, tensors, config, quantization_config(fmt, block))
    return expected


def write_tiny_fp8_block(
    folder: Path, fmt: str = "fp8", block: tuple[int, int] = (128, 128), seed: int = 0
) -> dict[str, torch.Tensor]:
    """Write a tiny Llama's checkpoint into `folder`; returns the float32 state dict it
    stands for."""
    config = tiny_config()
    torch.manual_seed(seed)
    state = LlamaForCausalLM(config).state_dict()
    return write_fp8_block_folder(folder, config, state, fmt, block)
