"""What device this process computes on: CUDA, ROCm or the CPU, and what the CPU can do.

ROCm builds of torch expose AMD GPUs through the `torch.cuda` API, so the two are told
apart by `torch.version.hip`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

PlatformName = Literal["cuda", "rocm", "cpu"]


_platform: PlatformName | None = None


def current_platform() -> PlatformName:
    """The platform of device 0, or "cpu" when no GPU is visible.

    Remembered in a module global rather than with functools.cache: kernels ask for it
    inside the compiled model step, where torch.compile reads a global as a constant but
    warns about (and traces through) a cached function.
    """
    global _platform
    if _platform is None:
        if torch.cuda.is_available():
            _platform = "rocm" if torch.version.hip else "cuda"
        else:
            _platform = "cpu"
    return _platform


def device() -> torch.device:
    """The torch device the engine computes on."""
    return torch.device("cpu" if current_platform() == "cpu" else "cuda")


def is_gpu() -> bool:
    return current_platform() != "cpu"


# CPU flags (as /proc/cpuinfo names them) under which bfloat16 matmuls run in hardware:
# Intel AMX tiles, or AVX-512 with its bfloat16 dot product (Cooper Lake, Sapphire
# Rapids, AMD Zen 4 and later). Elsewhere torch's bfloat16 matmuls run several times
# slower than float32 (measured ~7x on an AVX2 EPYC).
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags on the first "flags" line of a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return parse_cpu_flags(cpuinfo.read())
    except OSError:
        return frozenset()


def cpu_fast_bf16_flag() -> str | None:
    """The flag that makes bfloat16 matmuls fast on this CPU, or None."""
    flags = cpu_flags()
    return next((flag for flag in FAST_BF16_CPU_FLAGS if flag in flags), None)
