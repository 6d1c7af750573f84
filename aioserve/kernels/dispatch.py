"""Which implementation of each kernel runs: the Triton kernel or its torch reference.

On CUDA and ROCm the Triton kernels run. On the CPU Triton has no compiler, so the torch
references run, unless the backend is forced to "triton" (tests do this together with
TRITON_INTERPRET=1, which makes Triton interpret the kernels on the CPU).

The choice comes from the environment variable AIOSERVE_KERNEL_BACKEND (auto, triton,
reference) and can be changed at run time with `set_kernel_backend`.

VLLM_BATCH_INVARIANT=1 (vLLM's variable) asks for batch-invariant kernels: a row's result
the same bits whatever else is in its batch (`batch_invariant`, `set_batch_invariant`).
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

_batch_invariant_setting = os.environ.get("VLLM_BATCH_INVARIANT", "0")
if _batch_invariant_setting not in ("0", "1"):
    raise ValueError(f"VLLM_BATCH_INVARIANT must be 0 or 1, got {_batch_invariant_setting!r}")
_batch_invariant = _batch_invariant_setting == "1"


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


def set_batch_invariant(enabled: bool) -> None:
    """Turn batch-invariant kernels on or off for every kernel call after this."""
    global _batch_invariant
    _batch_invariant = enabled


def batch_invariant() -> bool:
    """True when each row's result must not depend on the rest of its batch."""
    return _batch_invariant
