"""What device this process computes on: CUDA, ROCm or the CPU, the GPU's architecture
family, and what the CPU can do.

ROCm builds of torch expose AMD GPUs through the `torch.cuda` API, so the two are told
apart by `torch.version.hip`.
"""

from __future__ import annotations

import functools
from typing import Literal, TypeVar

import torch

PlatformName = Literal["cuda", "rocm", "cpu"]
# The GPU families the Triton kernels' launch tables tell apart, each checked by compiling
# every launch for one member (tests/kernels/gpu_compile.py), and "cpu".
ArchName = Literal["hopper", "ampere", "cdna3", "cdna2", "rdna3", "cpu"]

T = TypeVar("T")

_platform: PlatformName | None = None
_arch: ArchName | None = None
_gpu: str | None = None
_compute_units: int | None = None


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


def gpu_name() -> str:
    """Device 0's architecture as compilers name it: "sm_90", "gfx942", ...; "" on the CPU."""
    global _gpu
    if _gpu is None:
        platform = current_platform()
        if platform == "cpu":
            _gpu = ""
        elif platform == "rocm":
            _gpu = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        else:
            major, minor = torch.cuda.get_device_capability(0)
            _gpu = f"sm_{major}{minor}"
    return _gpu


def compute_units() -> int:
    """Device 0's streaming multiprocessors (NVIDIA) or compute units (AMD), which a launch
    table's "per_unit" counts of resident programs multiply; 1 on the CPU, where Triton's
    interpreter runs one program at a time."""
    global _compute_units
    if _compute_units is None:
        gpu = current_platform() != "cpu"
        _compute_units = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 1
    return _compute_units


def current_arch() -> ArchName:
    """The launch-table family of device 0 (`arch_family`), or "cpu"."""
    global _arch
    if _arch is None:
        _arch = arch_family(current_platform(), gpu_name())
    return _arch


def arch_family(platform: PlatformName, gpu: str) -> ArchName:
    """The launch-table family of a GPU named as `gpu_name` does: on NVIDIA sm_90 and later
    "hopper" (Blackwell too, until it has rows of its own), sm_8x "ampere" (Ada too); on AMD
    gfx90a/gfx908 "cdna2", gfx11 and gfx12 (wave32) "rdna3", the rest (gfx94x, gfx950)
    "cdna3"."""
    if platform == "cpu":
        return "cpu"
    if platform == "cuda":
        return "hopper" if int(gpu.removeprefix("sm_")) >= 90 else "ampere"
    if gpu in ("gfx90a", "gfx908"):
        return "cdna2"
    if gpu.startswith(("gfx11", "gfx12")):
        return "rdna3"
    return "cdna3"


def e4m3_dtype() -> torch.dtype:
    """The e4m3 8-bit float this device computes with: float8_e4m3fnuz on AMD's MI300
    family (gfx94x), whose hardware format it is (no negative zero, exponent bias 8, largest
    value 240); float8_e4m3fn elsewhere (AMD's gfx950 and RDNA4 moved to it)."""
    return torch.float8_e4m3fnuz if gpu_name().startswith("gfx94") else torch.float8_e4m3fn


def e4m3_missing() -> str | None:
    """Why this device cannot hold e4m3 8-bit floats in a Triton kernel, or None: Triton
    types them only from NVIDIA's sm_89 (Ada, Hopper) on; AMD GPUs convert them in
    software where the hardware lacks them."""
    if current_platform() != "cuda" or int(gpu_name().removeprefix("sm_")) >= 89:
        return None
    return (
        f"this GPU ({gpu_name()}) has no e4m3 8-bit float in Triton, which types it from "
        "NVIDIA's sm_89 (Ada, Hopper) on"
    )


def launch_entry(table: dict[str, T]) -> T:
    """A Triton launch table's entry for this device: its architecture family's row where
    the table has one, else its platform's ("cuda", "rocm" or "cpu")."""
    arch = current_arch()
    return table[arch] if arch in table else table[current_platform()]


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
