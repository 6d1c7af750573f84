"""`triton` and `tl` for kernel modules, importable where Triton is not installed.

Triton is not a hard dependency (CUDA and ROCm builds of torch bring their own), so a
CPU install may lack it. There the kernel modules still import, and only their torch
references can run: launching a Triton kernel raises a clear error instead.
"""

from __future__ import annotations

import math
from typing import Any

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    HAVE_TRITON = False

    class _MissingKernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(
                f"Triton kernel {self.fn.__name__} needs the `triton` package, which is "
                "not installed; the torch reference runs on this machine instead"
            )

    class _TritonStub:
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            if fn is None:
                return _MissingKernel
            return _MissingKernel(fn)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))

    class _LanguageStub:
        constexpr = Any

        def __getattr__(self, name: str) -> Any:
            return None

    triton = _TritonStub()  # type: ignore[assignment]
    tl = _LanguageStub()  # type: ignore[assignment]

__all__ = ["HAVE_TRITON", "triton", "tl"]
