"""What bench/kernel_cases.py and its companion modules share: the shapes a kernel sees,
the Case they build, seeded random inputs, and the comparison with a torch reference.

Imported as `bench.kernel_case_types` (the repository root is on sys.path: pytest runs
from it and bench/kernel_bandwidth.py puts it there), so that kernel_cases, loaded as
`kernel_cases` by that script and as `bench.kernel_cases` by the tests, and the
companions it imports (kernel_cases_linear) share one copy of these types.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Largest ‖triton − reference‖ / ‖reference‖ accepted: a few units of the output's
# rounding (bf16 keeps 8 bits, fp16 11), float32 a little above its rounding.
_RELATIVE_TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one model that the kernels see."""

    name: str
    hidden: int  # H
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    head: int  # D
    intermediate: int  # I
    vocab: int  # V


@dataclass(frozen=True)
class TokenBatch:
    """The rows of a per-token kernel: one token of each of n sequences, or one prompt."""

    label: str
    n: int  # N
    is_prefill: bool

    @classmethod
    def decode(cls, n: int) -> TokenBatch:
        return cls(f"decode {n}", n, False)

    @classmethod
    def prefill(cls, n: int) -> TokenBatch:
        return cls(f"prefill {n}", n, True)


@dataclass
class Case:
    """One kernel call to check and time."""

    kernel: str
    model: str
    shape: str
    dtype: torch.dtype
    bytes: int
    flops: int
    run: Callable[[], object]
    check: Callable[[], str | None]


class Random:
    """Fresh random tensors on one device, from one seeded generator per case."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Tensor:
        values = torch.randn(shape, generator=self.generator, device=self.device, dtype=dtype)
        return values.mul_(scale) if scale != 1.0 else values

    def integers(self, low: int, high: int, *shape: int, dtype=torch.int64) -> Tensor:
        return torch.randint(
            low, high, shape, generator=self.generator, device=self.device, dtype=dtype
        )

    def bytes(self, *shape: int) -> Tensor:
        """uint8 `shape` of random bytes, drawn as int64s (8 times fewer draws), each row's
        cut to its width."""
        *rows, width = shape
        words = self.integers(-(2**63), 2**63 - 1, *rows, -(-width // 8))
        return words.view(torch.uint8)[..., :width].contiguous()

    def permutation(self, n: int) -> Tensor:
        return torch.randperm(n, generator=self.generator, device=self.device)

    def uniform(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device)


class Zeros(Random):
    """Inputs of the right shapes and dtypes, cheap to make: floats all zero, integers
    counting up through their range (distinct, as a case's ids must be). For recording the
    launches the launchers would make (tests/kernels/gpu_compile.py), where no kernel runs."""

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=dtype)

    def integers(self, low: int, high: int, *shape: int, dtype=torch.int64) -> Tensor:
        count = math.prod(shape)
        values = torch.arange(low, low + count, device=self.device)
        if count > high - low:
            values = values.sub_(low).remainder_(high - low).add_(low)
        return values.reshape(shape).to(dtype)

    def bytes(self, *shape: int) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=torch.uint8)

    def uniform(self, *shape: int) -> Tensor:
        return torch.zeros(shape, device=self.device)


def compare(out: Tensor, reference: Tensor, dtype: torch.dtype) -> str | None:
    """None when `out` matches `reference` to the dtype's relative tolerance; else why not."""
    if out.shape != reference.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(reference.shape)}"
    out64, ref64 = out.double(), reference.double()
    if not torch.isfinite(out64).all():
        return "non-finite values in the Triton output"
    error = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    tolerance = _RELATIVE_TOLERANCE[dtype]
    return None if error <= tolerance else f"relative error {error:.2e} > {tolerance:.0e}"


def cache_slots(rand: Random, batch: TokenBatch, block_size: int) -> tuple[Tensor, int]:
    """The batch's KV-cache slots and the pool's block count: a prompt's slots run on over
    shuffled blocks; one token of each of n sequences sits in a block of its own, at any
    offset."""
    n = batch.n
    if batch.is_prefill:
        num_blocks = math.ceil(n / block_size) + 1
        tokens = torch.arange(n, device=rand.device)
        blocks = rand.permutation(num_blocks)[tokens // block_size]
        return blocks * block_size + tokens % block_size, num_blocks
    num_blocks = n + 1
    slots = rand.permutation(num_blocks)[:n] * block_size + rand.integers(0, block_size, n)
    return slots, num_blocks


def fp8_kv_scales(kv_dtype: torch.dtype | None, device: torch.device) -> tuple:
    """(k_scale, v_scale) of an fp8 cache, () for a cache in the model's dtype: powers of
    two, so that a key made of fp8 numbers times its scale is written without rounding."""
    if kv_dtype is None:
        return ()
    return (torch.tensor([2.0**-4], device=device), torch.tensor([2.0**-3], device=device))


def kv_label(label: str, kv_dtype: torch.dtype | None) -> str:
    """A case's shape label, naming an fp8 cache's format."""
    return label if kv_dtype is None else f"{label}, {str(kv_dtype).removeprefix('torch.')} KV"
