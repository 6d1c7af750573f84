"""Copying a checkpoint's HF-named tensors into a model's parameters, shape-checked.

A model says where each checkpoint tensor goes: `parameter_for(hf_name)` gives the
parameter's name and, for a tensor stacked with others into one parameter (q/k/v, gate/up),
its shard index (None: the whole parameter; None for the pair: a tensor the model does not
take); `shard_rows(name, shard)` gives that shard's first row and row count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor, nn


class LoadsHFWeights(Protocol):
    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]: ...
    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None: ...
    def shard_rows(self, name: str, shard: int) -> tuple[int, int]: ...


def copy_hf_weights(model: LoadsHFWeights, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
    """Copy HF-named tensors into `model`'s parameters; returns the parameter names filled.

    ValueError for a tensor the model names a parameter for that it does not have, or one
    whose shape differs from its place."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        target = model.parameter_for(hf_name)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has no parameter in {type(model).__name__}"
            )
        if shard is None:
            copy_checked(params[name], tensor, name)
        else:
            start, size = model.shard_rows(name, shard)
            copy_checked(params[name].data[start : start + size], tensor, f"{name}[shard {shard}]")
        loaded.add(name)
    return loaded


def copy_checked(param: Tensor, tensor: Tensor, name: str) -> None:
    """Copy `tensor` into `param` (a parameter or a view of one); ValueError naming `name`
    when their shapes differ."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch for {name}: model has {tuple(param.shape)}, "
            f"checkpoint {tuple(tensor.shape)}"
        )
    with torch.no_grad():
        param.data.copy_(tensor)
