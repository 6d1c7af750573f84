"""aioserve/host_memory.py: a large buffer freed and taken again is not faulted in again,
and bfloat16 products of many shapes leave oneDNN's caches bounded.

Each case runs in a fresh interpreter, since the tuning is process-wide and must come before
torch is imported (a process that imported torch first is left untuned). The untuned control shows the measurement can tell the two apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc and page faults")

# Faults taken by the last four of five rounds of "allocate 64 MiB, write it, free it".
_ROUNDS = """
import json, resource, sys
from aioserve import host_memory
if sys.argv[1] == "tuned":
    host_memory.keep_host_memory()
    host_memory.keep_host_memory()  # a second call, as a bench script's and the CLI's, adds nothing
import torch
if sys.argv[1] == "torch first":
    host_memory.keep_host_memory()
torch.set_num_threads(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
start = None
for round in range(5):
    if round == 1:
        start = faults()
    buffer = torch.empty(16 << 20, dtype=torch.float32)
    buffer.fill_(1.0)
    del buffer
print(json.dumps({"faults": faults() - start, "changes": host_memory.changes}))
"""


# Resident growth (MiB) over bfloat16 products of 96 row counts with one SmolLM2 weight.
_SHAPES = """
import json, sys
from aioserve import host_memory
if sys.argv[1] == "tuned":
    host_memory.keep_host_memory()
import torch
torch.set_num_threads(1)
def resident_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
weight = torch.randn(3072, 576, dtype=torch.bfloat16)
with torch.inference_mode():
    torch.nn.functional.linear(torch.randn(700, 576, dtype=torch.bfloat16), weight)
    start = resident_mib()
    for rows in range(513, 513 + 96):
        torch.nn.functional.linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight)
print(json.dumps({"growth": resident_mib() - start, "changes": host_memory.changes}))
"""


def _run(script: str, mode: str, **env: str) -> dict:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MALLOC_")
        and key
        not in (
            "THP_MEM_ALLOC_ENABLE",
            "LD_PRELOAD",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
            "LRU_CACHE_CAPACITY",
        )
    }
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", script, mode],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_a_freed_buffer_is_reused_without_page_faults() -> None:
    tuned = _run(_ROUNDS, "tuned")
    assert tuned["changes"] == [
        "tensors of 2 MiB and more on transparent huge pages",
        "oneDNN caches 16 shapes (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY)",
        "glibc malloc keeps the large blocks it took (no mmap, no trim)",
    ]
    # 4 rounds × 64 MiB would be 65,536 faults of 4 KiB pages if each took fresh memory.
    # Reused, the rounds fault 0-2 pages; on an AMX Xeon VM one run in three or four took
    # 2,176 (8.5 MiB of 4 KiB pages, whatever oneDNN's cache sizes), so the bound is 8,000:
    # an eighth of the failure it is there to catch.
    assert tuned["faults"] < 8_000, tuned


def test_without_the_tuning_each_round_faults_its_buffer_in_again() -> None:
    untuned = _run(_ROUNDS, "untuned", THP_MEM_ALLOC_ENABLE="0")
    assert untuned["changes"] == []
    assert untuned["faults"] > 50_000, untuned


def test_a_process_that_imported_torch_first_is_left_alone() -> None:
    # As the test suite, which calls cli.main in process: tuned, it would keep its peak.
    late = _run(_ROUNDS, "torch first", THP_MEM_ALLOC_ENABLE="0")
    assert late["changes"] == []
    assert late["faults"] > 50_000, late


def test_an_allocator_the_user_chose_is_left_alone() -> None:
    chosen = _run(_ROUNDS, "tuned", MALLOC_ARENA_MAX="2", THP_MEM_ALLOC_ENABLE="0")
    # oneDNN's cache bound is not the allocator's: it holds whichever malloc runs.
    assert [c for c in chosen["changes"] if "oneDNN" not in c] == []


def test_onednn_caches_stay_bounded_over_many_product_shapes() -> None:
    untuned = _run(_SHAPES, "untuned")
    if untuned["growth"] < 64:
        # torch's bfloat16 products go through oneDNN's cached primitives only on CPUs with
        # bfloat16 instructions (AVX-512-BF16, AMX); elsewhere nothing grows either way.
        pytest.skip(f"this CPU's bfloat16 products kept {untuned['growth']:.0f} MiB untuned")
    tuned = _run(_SHAPES, "tuned")
    # On a Xeon with AMX: ~300 MiB untuned (96 shapes of ~3.3 MiB), ~90 MiB at 16 entries
    # per cache (~3 MiB an entry, both caches full).
    assert tuned["growth"] < untuned["growth"] / 2, (tuned, untuned)


def test_onednn_cache_sizes_the_user_chose_are_left_alone() -> None:
    chosen = _run(_ROUNDS, "tuned", ONEDNN_PRIMITIVE_CACHE_CAPACITY="4", LRU_CACHE_CAPACITY="4")
    assert not any("oneDNN" in change for change in chosen["changes"])
