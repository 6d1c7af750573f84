"""FP8 W8A8 weights: FP8 checkpoints (a Hugging Face folder whose `quantization_config`
says so) and `--quantization fp8`, which quantizes a 16-bit checkpoint at load.

`Fp8Scheme.from_config` accepts what kernels/fp8_linear*.py and fp8_block_linear*.py
compute, e4m3 weights with one scale per tensor, per output row or per block, and
activations quantized as they come (one scale a row, or a row's group of a block's columns
for block-wise weights), and refuses the rest by name. That is two formats:

- vLLM's own `fp8` (AutoFP8, `vllm`'s online quantization saved): `quant_method: "fp8"`,
  `activation_scheme: "dynamic"`, and with `weight_block_size: [rows, columns]` the
  block-wise ("fine-grained") FP8 of DeepSeek-V3 and Qwen3's `-FP8` models; the `"static"`
  scheme (a calibrated input scale) is refused;
- llm-compressor's `compressed-tensors` in its `float-quantized` format: 8-bit float
  weights with `tensor`, `channel` or `block` strategy and dynamic 8-bit float input
  activations (strategy `token`, or `tensor`, computed per row here: a finer scale, not the
  same bits; `group` of the block's columns for block weights).

A quantized layer is its `<prefix>.weight` in float8_e4m3fn beside `<prefix>.weight_scale`
(float, [], [1], [N] or [N, 1]; a block's, [⌈N / rows⌉, ⌈K / columns⌉], named
`weight_scale_inv` in the `fp8` format); layers the tool left out (`ignored_layers` /
`ignore`, usually the output head) are plain tensors. `fp8_layers` pairs them into
W8A8Layers (models/w8a8_layers.py, shared with INT8 checkpoints);
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

from aioserve.kernels.fp8_block_linear import check_triton_group
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
    block: tuple[int, int] | None = None  # block-wise scales' (rows, columns)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Scheme:
        """The scheme of a `quantization_config`; ValueError naming what is not supported."""
        method = str(config.get("quant_method", "unknown")).lower()
        if method == "fp8":
            scheme = config.get("activation_scheme", "dynamic")
            if scheme != "dynamic":
                raise ValueError(
                    f"fp8 with activation_scheme {scheme!r} is not supported: only 'dynamic' "
                    "(activations quantized as they come) is"
                )
            fmt = config.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ValueError(f"fp8 with fmt {fmt!r} is not supported: only 'e4m3' is")
            block = config.get("weight_block_size")
            return cls("fp8", _checked_block(block, "weight_block_size") if block else None)
        if method == "compressed-tensors":
            return cls("compressed-tensors", _check_compressed_tensors(config))
        raise ValueError(f"not an FP8 quantization method: {method!r}")

    def describe(self) -> str:
        """In words, for the load report."""
        source = "fp8" if self.method == "fp8" else "compressed-tensors"
        if self.block is None:
            return f"FP8 W8A8 (e4m3, {source}, activations scaled per row)"
        rows, columns = self.block
        return (
            f"FP8 W8A8 (e4m3, {source}, a scale a {rows}x{columns} block of weights, "
            f"activations scaled per row and {columns} columns)"
        )


def _checked_block(block: Any, field: str) -> tuple[int, int]:
    """A block-wise scheme's (rows, columns); ValueError naming `field` if it is not one the
    kernels compute (columns a power of two of at least 16; checkpoints use 128 x 128)."""
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(size, int) and size > 0 for size in block)
    ):
        raise ValueError(
            f"fp8 {field} must be two positive integers [rows, columns], got {block!r}"
        )
    try:
        check_triton_group(block[1])
    except ValueError as error:
        raise ValueError(f"fp8 {field} {list(block)}: {error}") from None
    return block[0], block[1]


def is_fp8_config(config: dict[str, Any]) -> bool:
    """Whether a `quantization_config` is one that Fp8Scheme reads (or refuses by name)."""
    method = str(config.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    return method == "compressed-tensors" and config.get("format") == "float-quantized"


def _check_compressed_tensors(config: dict[str, Any]) -> tuple[int, int] | None:
    """Check a compressed-tensors float-quantized config; its block (rows, columns) where
    the weights are block-wise, else None."""
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported: only 'float-quantized' "
            "(FP8 W8A8) and 'int-quantized' (INT8 W8A8) are"
        )
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors config without config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(
                f"compressed-tensors group {name!r}: only 8-bit float weights are supported"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(
                f"compressed-tensors group {name!r}: weight strategy {strategy!r} "
                "is not supported: only 'tensor', 'channel' or 'block' are"
            )
        inputs = group.get("input_activations")
        if not inputs or not inputs.get("dynamic") or inputs.get("type") != "float":
            raise ValueError(
                f"compressed-tensors group {name!r}: only dynamic 8-bit float input "
                "activations are supported (weight-only or static input scales are not)"
            )
        block = None
        if strategy == "block":
            block = _checked_block(weights.get("block_structure"), "block_structure")
            _check_block_inputs(name, inputs, block[1])
        blocks.add(block)
    if len(blocks) > 1:
        raise ValueError(
            "compressed-tensors groups with block-wise and other weight scales together are "
            "not supported"
        )
    return blocks.pop()


def _check_block_inputs(name: str, inputs: dict[str, Any], columns: int) -> None:
    """Block-wise weights take their inputs quantized per row and group of the block's
    columns (as vLLM computes them): a stated group of another size is refused."""
    strategy = inputs.get("strategy")
    if strategy == "group" and inputs.get("group_size") == columns:
        return
    raise ValueError(
        f"compressed-tensors group {name!r}: block-wise weights need input activations of "
        f"strategy 'group' with group_size {columns} (the block's columns), got "
        f"{strategy!r} with group_size {inputs.get('group_size')!r}"
    )


def fp8_layers(
    tensors: Iterable[tuple[str, Tensor]], scheme: Fp8Scheme
) -> Iterator[tuple[str, Tensor | W8A8Layer]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, W8A8Layer) for each FP8
    layer, from a folder's tensors in any order."""
    return paired_layers(tensors, _CHECKPOINT_DTYPE, _KIND, scheme.block)


def dequantized_weights(
    tensors: Iterable[tuple[str, Tensor]], scheme: Fp8Scheme
) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each FP8 layer as its float32 weight [N, K]."""
    return w8a8_layers.dequantized_weights(tensors, _CHECKPOINT_DTYPE, _KIND, scheme.block)


def _hold(module: Linear, layer: W8A8Layer, fp8_dtype: torch.dtype) -> int:
    """Give `module` the layer's fp8 weight and scales (moved to `fp8_dtype`), release its
    float weight; returns the bytes held."""
    weight, scale = layer.weight, layer.scale
    if fp8_dtype == torch.float8_e4m3fnuz:
        weight, scale = to_e4m3fnuz(weight, scale)
    device = module.weight.device
    module.fp8_weight = weight.contiguous().to(device)
    module.fp8_scale = scale.float().contiguous().to(device)
    module.fp8_block = layer.block
    module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
    return module.fp8_weight.nbytes + module.fp8_scale.nbytes


@torch.no_grad()
def keep_fp8_weights(
    model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]], fp8_dtype: torch.dtype
) -> int:
    """Give each Linear of `model` whose checkpoint tensors (`layers`) are all FP8 those
    tensors, for the Triton kernels, and release its float weight; returns the bytes kept."""
    kept = 0
    for module, layer in stacked_layers(model, layers):
        kept += _hold(module, layer, fp8_dtype)
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
                kept += _hold(module, W8A8Layer(weight, scale), fp8_dtype)
    return kept
