"""What device this process computes on: CUDA, ROCm or the CPU.

ROCm builds of torch expose AMD GPUs through the `torch.cuda` API, so the two are told
apart by `torch.version.hip`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

PlatformName = Literal["cuda", "rocm", "cpu"]


@functools.cache
def current_platform() -> PlatformName:
    """The platform of device 0, or "cpu" when no GPU is visible."""
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def device() -> torch.device:
    """The torch device the engine computes on."""
    return torch.device("cpu" if current_platform() == "cpu" else "cuda")


def is_gpu() -> bool:
    return current_platform() != "cpu"
