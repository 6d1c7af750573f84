"""The facts about this host that bug reports need: versions, device, CPUs, KV-cache size and
the environment variables that matter to aioserve, secrets hidden.

`environment_info()` gathers them as a dict (GET /server_info's "system_env");
`environment_report()` prints it as `aioserve collect-env` does. torch is imported when
they run, not with this module.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

from aioserve.config.arguments import CPU_KVCACHE_SPACE_ENV
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import cpu_kvcache_space_bytes

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
"""A variable whose name contains one of these has its value hidden."""
_ENV_ALWAYS_SHOWN = (
    CPU_KVCACHE_SPACE_ENV,
    "TRITON_INTERPRET",
    "AIOSERVE_KERNEL_BACKEND",
    "LRU_CACHE_CAPACITY",  # ideep's cache of oneDNN primitives (host_memory.py)
    "THP_MEM_ALLOC_ENABLE",
)
_ENV_PREFIXES = (
    "VLLM_",
    "AIOSERVE_",
    "TRITON_",
    "HF_",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "PYTORCH_",
    "ONEDNN_",
    "MALLOC_",
)
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "gguf")


def package_version(distribution: str) -> str | None:
    """The installed version of `distribution`, None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def is_secret(name: str) -> bool:
    """Whether the variable `name` may hold a secret (its name has a SECRET_MARKERS word)."""
    return any(marker in name for marker in SECRET_MARKERS)


def _environment_variables() -> dict[str, str | None]:
    """The variables that matter to aioserve (None: unset), secret values "<hidden>"."""
    names = sorted(set(_ENV_ALWAYS_SHOWN) | {n for n in os.environ if n.startswith(_ENV_PREFIXES)})
    shown: dict[str, str | None] = {}
    for name in names:
        value = os.environ.get(name)
        shown[name] = "<hidden>" if value is not None and is_secret(name) else value
    return shown


def environment_info() -> dict[str, Any]:
    """Versions, device, CPUs, CPU KV-cache size and variables, as JSON-ready values.

    Keys: versions (aioserve, python, the packages, triton; None: not installed),
    torch_build, os, platform, gpus (device names; [] on the CPU), gpu_architecture and
    launch_tables (None on the CPU), cpus, usable_cpus (None: unknown),
    cpu_kvcache_space_bytes and cpu_kvcache_error (one of them None), environment.
    """
    import torch

    from aioserve.platform import current_arch, current_platform, gpu_name

    versions = {"aioserve": package_version("aioserve"), "python": sys.version.split()[0]}
    versions.update((name, package_version(name)) for name in _PACKAGES)
    versions["triton"] = package_version("triton") or package_version("pytorch-triton-rocm")
    device = current_platform()
    on_gpu = device != "cpu"
    try:
        kv_bytes, kv_error = cpu_kvcache_space_bytes(), None
    except ConfigError as error:
        kv_bytes, kv_error = None, str(error)
    return {
        "versions": versions,
        "torch_build": {"cuda": torch.version.cuda, "hip": torch.version.hip},
        "os": platform.platform(),
        "platform": device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if on_gpu
        else [],
        "gpu_architecture": gpu_name() if on_gpu else None,
        "launch_tables": current_arch() if on_gpu else None,
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_kvcache_space_bytes": kv_bytes,
        "cpu_kvcache_error": kv_error,
        "environment": _environment_variables(),
    }


def environment_report() -> str:
    """What `aioserve collect-env` prints: `environment_info()` as "name: value" lines."""
    info = environment_info()
    versions = dict(info["versions"])
    lines = [f"aioserve: {versions.pop('aioserve')}", f"python: {versions.pop('python')}"]
    lines += [f"{name}: {version or 'not installed'}" for name, version in versions.items()]
    build = info["torch_build"]
    lines.append(f"torch build: cuda {build['cuda']}, hip {build['hip']}")
    lines.append(f"os: {info['os']}")
    lines.append(f"platform: {info['platform']}")
    if info["platform"] != "cpu":
        names = info["gpus"]
        lines.append(f"gpus: {len(names)} x {', '.join(dict.fromkeys(names))}")
        lines.append(
            f"gpu architecture: {info['gpu_architecture']} (launch tables: {info['launch_tables']})"
        )
    lines.append(
        f"cpus: {info['cpus']} (usable by this process: {info['usable_cpus'] or 'unknown'})"
    )
    if info["cpu_kvcache_error"] is None:
        lines.append(f"cpu kv cache: {info['cpu_kvcache_space_bytes'] / 2**30:g} GiB")
    else:
        lines.append(f"cpu kv cache: invalid ({info['cpu_kvcache_error']})")
    lines.append("environment:")
    for name, value in info["environment"].items():
        lines.append(f"  {name}={'<unset>' if value is None else value}")
    return "\n".join(lines)
