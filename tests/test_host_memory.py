"""aioserve/host_memory.py: a large buffer freed and taken again is not faulted in again.

Each case runs in a fresh interpreter, since the tuning is process-wide and must come before
torch is imported. The untuned control shows the measurement can tell the two apart.
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
import torch
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


def _rounds(mode: str, **env: str) -> dict:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MALLOC_") and key not in ("THP_MEM_ALLOC_ENABLE", "LD_PRELOAD")
    }
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_a_freed_buffer_is_reused_without_page_faults() -> None:
    tuned = _rounds("tuned")
    assert tuned["changes"] == [
        "tensors of 2 MiB and more on transparent huge pages",
        "glibc malloc keeps the large blocks it took (no mmap, no trim)",
    ]
    # 4 rounds × 64 MiB would be 65,536 faults of 4 KiB pages if each took fresh memory.
    assert tuned["faults"] < 2_000, tuned


def test_without_the_tuning_each_round_faults_its_buffer_in_again() -> None:
    untuned = _rounds("untuned", THP_MEM_ALLOC_ENABLE="0")
    assert untuned["changes"] == []
    assert untuned["faults"] > 50_000, untuned


def test_an_allocator_the_user_chose_is_left_alone() -> None:
    chosen = _rounds("tuned", MALLOC_ARENA_MAX="2", THP_MEM_ALLOC_ENABLE="0")
    assert chosen["changes"] == []
