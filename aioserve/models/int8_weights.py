"""INT8 W8A8 weights: llm-compressor's `compressed-tensors` checkpoints in their
`int-quantized` format, the W8A8 int8 models vLLM-CPU serves with oneDNN.

`Int8Scheme.from_config` accepts what kernels/int8_linear*.py compute, and refuses the rest
by name: symmetric 8-bit integer weights with `channel` or `tensor` strategy, and 8-bit
integer input activations quantized as they come, symmetric, with `token` strategy (or
`tensor`, computed per row here: a finer scale, not the same bits). Static input scales,
asymmetric activations, weight-only schemes and group-wise weights are refused.

The layers pair up as models/w8a8_layers.py says (`<prefix>.weight` int8 beside
`<prefix>.weight_scale`). Each Linear whose checkpoint tensors are all INT8 holds them
(`keep_int8_weights`), on a GPU and on a CPU with VNNI or AMX (engine/build.py), and its
float weight is released: the CPU multiplies them with torch's int8 GEMM (oneDNN), a GPU
with the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from aioserve.models import w8a8_layers
from aioserve.models.w8a8_layers import W8A8Layer, paired_layers, stacked_layers

_KIND = "int8"


@dataclass(frozen=True)
class Int8Scheme:
    """How a folder's layers are quantized to INT8, from its `quantization_config`."""

    method: str = "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Scheme:
        """The scheme of a `quantization_config`; ValueError naming what is not supported."""
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors config without config_groups")
        for name, group in groups.items():
            _check_weights(name, group.get("weights") or {})
            _check_inputs(name, group.get("input_activations"))
        return cls()

    def describe(self) -> str:
        """In words, for the load report."""
        return "INT8 W8A8 (compressed-tensors, symmetric, activations scaled per row)"


def is_int8_config(config: dict[str, Any]) -> bool:
    """Whether a `quantization_config` is one that Int8Scheme reads (or refuses by name)."""
    return (
        str(config.get("quant_method", "")).lower() == "compressed-tensors"
        and config.get("format") == "int-quantized"
    )


def _check_weights(group: str, weights: dict[str, Any]) -> None:
    if (weights.get("type"), weights.get("num_bits")) != ("int", 8):
        raise ValueError(
            f"compressed-tensors group {group!r}: only 8-bit integer weights are supported "
            "in the int-quantized format"
        )
    if weights.get("strategy") not in ("tensor", "channel"):
        raise ValueError(
            f"compressed-tensors group {group!r}: weight strategy {weights.get('strategy')!r} "
            "is not supported: only 'tensor' or 'channel' are"
        )
    if not weights.get("symmetric", True):
        raise ValueError(
            f"compressed-tensors group {group!r}: asymmetric weights are not supported"
        )


def _check_inputs(group: str, inputs: dict[str, Any] | None) -> None:
    if not inputs or not inputs.get("dynamic") or inputs.get("type") != "int":
        raise ValueError(
            f"compressed-tensors group {group!r}: only dynamic 8-bit integer input "
            "activations are supported (weight-only or static input scales are not)"
        )
    if inputs.get("num_bits") != 8 or not inputs.get("symmetric", True):
        raise ValueError(
            f"compressed-tensors group {group!r}: only symmetric 8-bit input activations "
            "are supported"
        )
    if inputs.get("strategy") not in ("token", "tensor"):
        raise ValueError(
            f"compressed-tensors group {group!r}: input strategy {inputs.get('strategy')!r} "
            "is not supported: only 'token' or 'tensor' are"
        )


def int8_layers(
    tensors: Iterable[tuple[str, Tensor]],
) -> Iterator[tuple[str, Tensor | W8A8Layer]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, W8A8Layer) for each INT8
    layer, from a folder's tensors in any order."""
    return paired_layers(tensors, torch.int8, _KIND)


def dequantized_weights(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each INT8 layer as its float32 weight [N, K]."""
    return w8a8_layers.dequantized_weights(tensors, torch.int8, _KIND)


@torch.no_grad()
def keep_int8_weights(model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]]) -> int:
    """Give each Linear of `model` whose checkpoint tensors (`layers`) are all INT8 those
    tensors (int8 [N, K], float32 scales [1] or [N]) and release its float weight; returns
    the bytes kept."""
    kept = 0
    for module, layer in stacked_layers(model, layers):
        device = module.weight.device
        module.int8_weight = layer.weight.contiguous().to(device)
        module.int8_scale = layer.scale.float().contiguous().to(device)
        module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
        kept += module.int8_weight.nbytes + module.int8_scale.nbytes
    return kept
