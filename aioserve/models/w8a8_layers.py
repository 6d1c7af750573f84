"""A W8A8 checkpoint's layers, FP8 (models/fp8_weights.py) or INT8 (models/int8_weights.py):
8-bit weights beside their scales, paired up from a folder's tensors and stacked for the
model's fused Linears.

A quantized layer is its `<prefix>.weight` in the checkpoint's 8-bit type beside
`<prefix>.weight_scale` (float, [], [1], [N] or [N, 1]); in a block-wise FP8 checkpoint
(`block` given) the scale is a block's, [⌈N / rows⌉, ⌈K / columns⌉], and DeepSeek's and
Qwen's `fp8` folders name it `<prefix>.weight_scale_inv` (a multiplier all the same). Layers
the tool left out (usually the output head) are plain tensors. A static
`<prefix>.input_scale` is refused: only activations quantized as they come are computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from aioserve.kernels.fp8_block_linear_reference import dequantize_blocks, scale_shape
from aioserve.models.linear import Linear


@dataclass(frozen=True)
class W8A8Layer:
    """One checkpoint weight: 8-bit values [N, K] and float32 scales: [1] or [N], or with
    `block` (rows, columns) one a block, [⌈N / rows⌉, ⌈K / columns⌉]
    (kernels/fp8_block_linear_reference.py)."""

    weight: Tensor
    scale: Tensor
    block: tuple[int, int] | None = None

    def dequantize(self) -> Tensor:
        if self.block is not None:
            return dequantize_blocks(self.weight, self.scale, self.block)
        return self.weight.float() * self.scale.reshape(-1, 1)

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


def _layer(prefix: str, weight: Tensor, scale: Tensor, block: tuple[int, int] | None) -> W8A8Layer:
    if weight.dim() != 2:
        raise ValueError(f"{prefix}.weight is {tuple(weight.shape)}: expected [N, K]")
    if block is not None:
        expected = scale_shape(*weight.shape, block)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{prefix}'s block scales are {list(scale.shape)} for a weight of "
                f"{tuple(weight.shape)} in blocks of {list(block)}: expected {list(expected)}"
            )
        return W8A8Layer(weight, scale.float(), block)
    rows = weight.shape[0]
    scale = scale.float().reshape(-1)
    if scale.numel() not in (1, rows):
        raise ValueError(
            f"{prefix}.weight_scale has {scale.numel()} values for a weight of "
            f"{tuple(weight.shape)}: expected 1 or {rows}"
        )
    return W8A8Layer(weight, scale)


# The names of a layer's scales: DeepSeek's and Qwen's block-wise `fp8` folders call the
# multiplier `weight_scale_inv`.
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def paired_layers(
    tensors: Iterable[tuple[str, Tensor]],
    stored: torch.dtype,
    kind: str,
    block: tuple[int, int] | None = None,
) -> Iterator[tuple[str, Tensor | W8A8Layer]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, W8A8Layer) for each
    layer whose weight is `stored` (the checkpoint's 8-bit type, named `kind` in errors),
    with scales a block of `block` where given, from a folder's tensors in any order. An
    all-zero `weight_zero_point` (what a symmetric scheme may save) is dropped; any other
    is refused."""
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        suffix = "weight_scale" if suffix in _SCALE_SUFFIXES else suffix
        if suffix == "input_scale":
            raise ValueError(
                f"the checkpoint holds {name}: a static input scale, which is not supported"
            )
        if suffix == "weight_zero_point":
            if torch.count_nonzero(tensor):
                raise ValueError(
                    f"the checkpoint holds {name} with nonzero values: asymmetric weights "
                    "are not supported"
                )
            continue
        quantized = suffix == "weight" and tensor.dtype == stored
        if not quantized and suffix != "weight_scale":
            if tensor.dtype.itemsize == 1 and (
                tensor.is_floating_point() or tensor.dtype == torch.int8
            ):
                raise ValueError(f"{name} is {tensor.dtype}: only {kind} weights are read")
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if parts.keys() == {"weight", "weight_scale"}:
            del pending[prefix]
            yield f"{prefix}.weight", _layer(prefix, parts["weight"], parts["weight_scale"], block)
    for prefix, parts in pending.items():
        missing = "weight_scale" if "weight" in parts else f"an {kind} weight"
        raise ValueError(f"the checkpoint's layer {prefix} lacks {missing}")


def dequantized_weights(
    tensors: Iterable[tuple[str, Tensor]],
    stored: torch.dtype,
    kind: str,
    block: tuple[int, int] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each quantized layer as its float32 weight [N, K]."""
    for name, value in paired_layers(tensors, stored, kind, block):
        yield name, value.dequantize() if isinstance(value, W8A8Layer) else value


def count_layers(names: Iterable[str]) -> int:
    """How many tensors `dequantized_weights` yields for tensors named `names`."""
    return sum(
        not name.endswith((".weight_scale", ".weight_scale_inv", ".weight_zero_point"))
        for name in names
    )


def stacked_layers(
    model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]]
) -> Iterator[tuple[Linear, W8A8Layer]]:
    """Each Linear of `model` whose checkpoint tensors (`layers`) are all quantized, with
    its layer: the 8-bit weight (stacked q/k/v and gate/up shards side by side, in
    `load_weights`' order) and its float32 scales: [1] for one shard of one scale, else one
    a row (each shard's per-tensor scale spread over its own rows); block scales stacked as
    they are where every shard starts on a block's first row, else spread to one scale row
    a weight row (block (1, columns))."""
    shards: dict[str, dict[int, W8A8Layer]] = {}
    for hf_name, layer in layers:
        target = model.parameter_for(hf_name)
        if target is not None:
            name, shard = target
            shards.setdefault(name, {})[shard or 0] = layer
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight"
        parts = shards.get(name, {})
        if not (isinstance(module, Linear) and parts and len(parts) == model.shard_count(name)):
            continue
        ordered = [parts[i] for i in sorted(parts)]
        weight = torch.cat([shard.weight for shard in ordered])
        yield module, W8A8Layer(weight, *stacked_scales(ordered))


def stacked_scales(shards: list[W8A8Layer]) -> tuple[Tensor, tuple[int, int] | None]:
    """The scales (and block) of `shards` stacked row-wise into one layer."""
    block = shards[0].block
    if len(shards) == 1:
        return shards[0].scale, block
    if block is None:
        return torch.cat([shard.scale.expand(shard.rows) for shard in shards]), None
    rows, columns = block
    if all(shard.rows % rows == 0 for shard in shards[:-1]):
        return torch.cat([shard.scale for shard in shards]), block
    spread = [shard.scale.repeat_interleave(rows, 0)[: shard.rows] for shard in shards]
    return torch.cat(spread), (1, columns)
