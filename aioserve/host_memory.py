"""How the serving process takes host memory: large blocks kept once taken, on huge pages.

A CPU model step allocates its activations afresh every layer (inductor's buffers, tens of
megabytes at a 4,096-token prefill). glibc's malloc serves blocks over 32 MiB with `mmap`
and gives them back with `munmap`, so every such buffer is faulted in and zeroed by the
kernel page by page, every layer, every step: a 64-prompt prefill took 3.3 million page
faults where 1.5 million are the KV pool's and the weights' first touch. vLLM avoids this
by preloading tcmalloc into its CPU workers; here glibc itself is told to keep what it
took (no `mmap` for large blocks, no trimming of the heap), which measured the same as
tcmalloc (bench/RESULTS.md). Tensors of 2 MiB and more also go on transparent huge pages
(torch's `THP_MEM_ALLOC_ENABLE`): on a Zen 5 EPYC the steps ran ~3% faster. The CPU KV
pool is the exception (`on_small_pages`, runner/kv_memory.py): under KVM, its first touch
on huge pages took 7.6-9.6 s for 4 GiB on one core, against 1.4-1.9 s on 4 KiB pages, the
last thing before ready, for 1-2% of throughput at 1,536-token contexts and none measured
at 256 (bench/RESULTS.md).

The cost: memory the process freed stays in its heap, so its resident size is its peak,
not its current use. Nothing here applies where the user chose otherwise: another
allocator in `LD_PRELOAD`, or any of glibc's `MALLOC_*` tunables, or `THP_MEM_ALLOC_ENABLE`
already set.

oneDNN's caches are bounded too. torch's bfloat16 matmuls on the CPU go through oneDNN,
which builds a primitive for every shape it meets and keeps it in two caches of 1,024
entries each (oneDNN's own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, and ideep's over it,
`LRU_CACHE_CAPACITY`). On a Xeon with AMX one SmolLM2 product kept 0.4-3.3 MiB a shape,
and a served step's token count is a new shape for every layer's products: a bfloat16
server's resident set grew by 200 MiB over 1,500 soak requests and had not stopped
(bench/RESULTS.md). A step uses one shape per weight, five in all, so ONEDNN_CACHE_ENTRIES
of each still holds the shapes of the last few steps; a new shape costs ~0.7 ms to build.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import sys
from collections.abc import Mapping

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4

_NEVER_TRIM = 2**31 - 1  # mallopt takes a C int
_TOP_PAD_BYTES = 256 << 20

_USER_ALLOCATOR_HINTS = ("tcmalloc", "jemalloc", "mimalloc")

ONEDNN_CACHE_ENTRIES = 16
_ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _user_chose_allocator(env: Mapping[str, str]) -> bool:
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in _USER_ALLOCATOR_HINTS):
        return True
    return any(key.startswith("MALLOC_") for key in env) or "GLIBC_TUNABLES" in env


# What keep_host_memory changed in this process, for the start-up log.
changes: list[str] = []


def _set_torch_variables() -> None:
    """The environment variables torch reads once, where the user did not set them."""
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        changes.append("tensors of 2 MiB and more on transparent huge pages")
    unset = [name for name in _ONEDNN_CACHE_VARIABLES if name not in os.environ]
    for name in unset:
        os.environ[name] = str(ONEDNN_CACHE_ENTRIES)
    if unset:
        changes.append(f"oneDNN caches {ONEDNN_CACHE_ENTRIES} shapes ({', '.join(unset)})")


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@functools.cache  # once a process: a bench script calls it before the CLI does
def keep_host_memory() -> None:
    """Tune this process's allocators as the module says, recording what changed in `changes`.

    Call before torch is imported: torch reads `THP_MEM_ALLOC_ENABLE` once, at its first
    allocation, and ideep reads `LRU_CACHE_CAPACITY` when torch is loaded. A process that
    imported torch before (a program calling `cli.main`, the test suite) is left as it is:
    its allocator is that program's, and malloc keeping every block would hold its peak
    for the rest of its life.
    """
    if "torch" in sys.modules:
        return
    _set_torch_variables()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    if _user_chose_allocator(os.environ):
        return
    applied = all(
        _libc().mallopt(parameter, value) == 1
        for parameter, value in (
            (_M_MMAP_MAX, 0),
            (_M_TRIM_THRESHOLD, _NEVER_TRIM),
            (_M_TOP_PAD, _TOP_PAD_BYTES),
        )
    )
    if applied:
        changes.append("glibc malloc keeps the large blocks it took (no mmap, no trim)")


_MADV_NOHUGEPAGE = 15  # from <sys/mman.h>


def on_small_pages(address: int, size: int) -> bool:
    """Ask the kernel to back [address, address + size) with base pages (4 KiB on x86),
    not huge ones; call before the memory is first touched. Returns whether the kernel
    agreed (False off Linux or for a range too small to hold a whole page)."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + size) // page * page
    if platform.system() != "Linux" or end <= start:
        return False
    return _libc().madvise(start, end - start, _MADV_NOHUGEPAGE) == 0
