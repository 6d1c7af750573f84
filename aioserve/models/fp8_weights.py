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
usually the output head) are plain tensors. `fp8_layers` pairs them into `Fp8Layer`s;
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
from aioserve.models.linear import Linear

METHODS = ("fp8", "compressed-tensors")
_CHECKPOINT_DTYPE = torch.float8_e4m3fn


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
            "(FP8 W8A8) is"
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


@dataclass(frozen=True)
class Fp8Layer:
    """One FP8 checkpoint weight: e4m3 values [N, K] and float32 scales [1] or [N]."""

    weight: Tensor
    scale: Tensor

    def dequantize(self) -> Tensor:
        return self.weight.float() * self.scale.reshape(-1, 1)

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


def _layer(prefix: str, weight: Tensor, scale: Tensor) -> Fp8Layer:
    rows = weight.shape[0]
    scale = scale.float().reshape(-1)
    if weight.dim() != 2 or scale.numel() not in (1, rows):
        raise ValueError(
            f"{prefix}.weight_scale has {scale.numel()} values for a weight of "
            f"{tuple(weight.shape)}: expected 1 or {rows}"
        )
    return Fp8Layer(weight, scale)


def fp8_layers(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor | Fp8Layer]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, Fp8Layer) for each FP8
    layer, from a folder's tensors in any order."""
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix == "input_scale":
            raise ValueError(
                f"the checkpoint holds {name}: a static input scale, which is not supported"
            )
        quantized = suffix == "weight" and tensor.dtype == _CHECKPOINT_DTYPE
        if not quantized and suffix != "weight_scale":
            if tensor.dtype.itemsize == 1 and tensor.is_floating_point():
                raise ValueError(f"{name} is {tensor.dtype}: only e4m3fn FP8 weights are read")
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if parts.keys() == {"weight", "weight_scale"}:
            del pending[prefix]
            yield f"{prefix}.weight", _layer(prefix, parts["weight"], parts["weight_scale"])
    for prefix, parts in pending.items():
        missing = "weight_scale" if "weight" in parts else "an FP8 weight"
        raise ValueError(f"the checkpoint's layer {prefix} lacks {missing}")


def dequantized_weights(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each FP8 layer as its float32 weight [N, K]."""
    for name, value in fp8_layers(tensors):
        yield name, value.dequantize() if isinstance(value, Fp8Layer) else value


def count_layers(names: Iterable[str]) -> int:
    """How many tensors `dequantized_weights` yields for tensors named `names`."""
    return sum(not name.endswith(".weight_scale") for name in names)


def _kept(
    model: nn.Module, layers: Iterable[tuple[str, Fp8Layer]]
) -> Iterator[tuple[Linear, list[Fp8Layer]]]:
    """Each Linear of `model` whose checkpoint tensors are all FP8, with its shards in
    stacking order."""
    shards: dict[str, dict[int, Fp8Layer]] = {}
    for hf_name, layer in layers:
        target = model.parameter_for(hf_name)
        if target is not None:
            name, shard = target
            shards.setdefault(name, {})[shard or 0] = layer
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight"
        parts = shards.get(name, {})
        if isinstance(module, Linear) and parts and len(parts) == model.shard_count(name):
            yield module, [parts[i] for i in sorted(parts)]


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
    model: nn.Module, layers: Iterable[tuple[str, Fp8Layer]], fp8_dtype: torch.dtype
) -> int:
    """Give each Linear of `model` whose checkpoint tensors (`layers`) are all FP8 those
    tensors, for the Triton kernels, and release its float weight; returns the bytes kept."""
    kept = 0
    for module, shards in _kept(model, layers):
        weight = torch.cat([shard.weight for shard in shards])
        if len(shards) == 1:
            scale = shards[0].scale
        else:  # a scale a row, each shard's (one or one a row) over its own rows
            scale = torch.cat([shard.scale.expand(shard.rows) for shard in shards])
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
