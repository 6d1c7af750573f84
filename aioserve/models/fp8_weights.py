"""FP8 W8A8 weights: FP8 checkpoints (a Hugging Face folder whose `quantization_config`
says so) and `--quantization fp8`, which quantizes a 16-bit checkpoint at load.

`Fp8Scheme.from_config` accepts what kernels/fp8_linear*.py compute, e4m3 weights with one
scale per tensor or per output row and activations quantized as they come, one scale per
row, and refuses the rest by name. That is two formats:

- vLLM's own `fp8` (AutoFP8, `vllm`'s online quantization saved): `quant_method: "fp8"`,
  `activation_scheme: "dynamic"`; `weight_block_size` (block-wise scales) and the
  `"static"` scheme (a calibrated input scale) are refused;
- llm-compressor's `compressed-tensors` in its `float-quantized` format: 8-bit float
  weights with `tensor` or `channel` strategy and dynamic 8-bit float input activations
  (strategy `token`, or `tensor`, computed per row here: a finer scale, not the same bits).

A quantized layer is its `<prefix>.weight` in float8_e4m3fn beside `<prefix>.weight_scale`
(float, [], [1], [N] or [N, 1]); layers the tool left out (`ignored_layers` / `ignore`,
usually the output head) are plain tensors. `fp8_layers` pairs them into W8A8Layers
(models/w8a8_layers.py, shared with INT8 checkpoints);
`dequantized_weights` turns each into the float32 weight it stands for, which is what the
model loads: on the CPU, which has no fp8 matmul worth using (kernels/
fp8_linear_reference.py), the model computes on those weights in its dtype.

On a GPU (`keep_fp8_weights`) each Linear whose checkpoint tensors are all FP8 holds them
(stacked q/k/v and gate/up shards side by side, in `load_weights`' order, per-tensor scales
spread over their shard's rows) and its float weight is released, as models/gguf_weights.py
does for GGUF; on ROCm they move to e4m3fnuz. `quantize_to_fp8` gives every decoder Linear
of a 16-bit model per-row fp8 weights (vLLM's online `--quantization fp8` uses one scale a
tensor; a scale a row costs the kernel nothing and rounds each row to its own range).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from aioserve.kernels.fp8_linear_reference import quantize_weight, to_e4m3fnuz
from aioserve.models import w8a8_layers
from aioserve.models.linear import Linear
from aioserve.models.w8a8_layers import W8A8Layer, paired_layers, stacked_layers

METHODS = ("fp8", "compressed-tensors")
_CHECKPOINT_DTYPE = torch.float8_e4m3fn
_KIND = "e4m3fn FP8"


@dataclass(frozen=True)
class Fp8Scheme:
    """How a folder's layers are quantized to FP8, from its `quantization_config`."""

    method: str  # "fp8" or "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Scheme:
        """The scheme of a `quantization_config`; ValueError naming what is not supported."""
        method = str(config.get("quant_method", "unknown")).lower()
        if method == "fp8":
            if config.get("weight_block_size"):
                raise ValueError(
                    "fp8 with block-wise weight scales (weight_block_size "
                    f"{config['weight_block_size']}) is not supported: only per-tensor or "
                    "per-channel scales are"
                )
            scheme = config.get("activation_scheme", "dynamic")
            if scheme != "dynamic":
                raise ValueError(
                    f"fp8 with activation_scheme {scheme!r} is not supported: only 'dynamic' "
                    "(activations quantized as they come) is"
                )
            return cls("fp8")
        if method == "compressed-tensors":
            _check_compressed_tensors(config)
            return cls("compressed-tensors")
        raise ValueError(f"not an FP8 quantization method: {method!r}")

    def describe(self) -> str:
        """In words, for the load report."""
        source = "fp8" if self.method == "fp8" else "compressed-tensors"
        return f"FP8 W8A8 (e4m3, {source}, activations scaled per row)"


def is_fp8_config(config: dict[str, Any]) -> bool:
    """Whether a `quantization_config` is one that Fp8Scheme reads (or refuses by name)."""
    method = str(config.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    return method == "compressed-tensors" and config.get("format") == "float-quantized"


def _check_compressed_tensors(config: dict[str, Any]) -> None:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported: only 'float-quantized' "
            "(FP8 W8A8) and 'int-quantized' (INT8 W8A8) are"
        )
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors config without config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(
                f"compressed-tensors group {name!r}: only 8-bit float weights are supported"
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors group {name!r}: weight strategy {weights.get('strategy')!r} "
                "is not supported: only 'tensor' or 'channel' are"
            )
        inputs = group.get("input_activations")
        if not inputs or not inputs.get("dynamic") or inputs.get("type") != "float":
            raise ValueError(
                f"compressed-tensors group {name!r}: only dynamic 8-bit float input "
                "activations are supported (weight-only or static input scales are not)"
            )


def fp8_layers(
    tensors: Iterable[tuple[str, Tensor]],
) -> Iterator[tuple[str, Tensor | W8A8Layer]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, W8A8Layer) for each FP8
    layer, from a folder's tensors in any order."""
    return paired_layers(tensors, _CHECKPOINT_DTYPE, _KIND)


def dequantized_weights(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each FP8 layer as its float32 weight [N, K]."""
    return w8a8_layers.dequantized_weights(tensors, _CHECKPOINT_DTYPE, _KIND)


def _hold(module: Linear, weight: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> int:
    """Give `module` the fp8 weight and scales (moved to `fp8_dtype`), release its float
    weight; returns the bytes held."""
    if fp8_dtype == torch.float8_e4m3fnuz:
        weight, scale = to_e4m3fnuz(weight, scale)
    device = module.weight.device
    module.fp8_weight = weight.to(device)
    module.fp8_scale = scale.float().to(device)
    module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
    return module.fp8_weight.nbytes + module.fp8_scale.nbytes


@torch.no_grad()
def keep_fp8_weights(
    model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]], fp8_dtype: torch.dtype
) -> int:
    """Give each Linear of `model` whose checkpoint tensors (`layers`) are all FP8 those
    tensors, for the Triton kernels, and release its float weight; returns the bytes kept."""
    kept = 0
    for module, weight, scale in stacked_layers(model, layers):
        kept += _hold(module, weight, scale, fp8_dtype)
    return kept


@torch.no_grad()
def quantize_to_fp8(model: nn.Module, fp8_dtype: torch.dtype) -> int:
    """`--quantization fp8` on a 16-bit model: every Linear of its decoder layers (not the
    output head, as vLLM) gets fp8 weights with a scale a row; returns the bytes held."""
    kept = 0
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                weight, scale = quantize_weight(module.weight, torch.float8_e4m3fn)
                kept += _hold(module, weight, scale, fp8_dtype)
    return kept
