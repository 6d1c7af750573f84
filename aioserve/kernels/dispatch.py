"""Which implementation of each kernel runs: the Triton kernel or its torch reference.

On CUDA and ROCm the Triton kernels run. On the CPU Triton has no compiler, so the torch
references run, unless the backend is forced to "triton" (tests do this together with
TRITON_INTERPRET=1, which makes Triton interpret the kernels on the CPU).

The choice comes from the environment variable AIOSERVE_KERNEL_BACKEND (auto, triton,
reference) and can be changed at run time with `set_kernel_backend`.
"""

from __future__ import annotations

import os
from typing import Literal

from aioserve.platform import is_gpu

KernelBackend = Literal["auto", "triton", "reference"]
_BACKENDS = ("auto", "triton", "reference")

_backend: str = os.environ.get("AIOSERVE_KERNEL_BACKEND", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"AIOSERVE_KERNEL_BACKEND must be one of {_BACKENDS}, got {_backend!r}")


def set_kernel_backend(backend: KernelBackend) -> None:
    """Force the Triton kernels or the torch references for every kernel call after this."""
    global _backend
    if backend not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {backend!r}")
    _backend = backend


def kernel_backend() -> KernelBackend:
    return _backend  # type: ignore[return-value]


def use_triton() -> bool:
    """True when kernels should run their Triton implementation."""
    if _backend == "auto":
        return is_gpu()
    return _backend == "triton"
