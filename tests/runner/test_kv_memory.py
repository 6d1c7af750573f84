"""The KV pool as the runner allocates it: on the CPU in the layouts the torch path reads
best (where decodes weigh the pool in place, bfloat16 and float32 without AVX-512:
dim-major keys, head-major values; elsewhere they gather from head-major pools), and
zeroed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aioserve.kernels import kv_cache
from aioserve.kernels.decode_in_pool import reads_in_place
from aioserve.runner.kv_memory import KVZeroing, allocate_kv_caches
from tests.child_process import die_with_parent
from tests.models.tiny_models import tiny_configs


@pytest.mark.parametrize(
    ("dtype", "avx512", "in_place"),
    [
        (torch.bfloat16, True, True),
        (torch.float32, False, True),
        (torch.float32, True, False),  # float32 gathers on AVX-512 (decode_in_pool.py)
    ],
)
def test_the_cpu_pool_is_stored_as_the_torch_path_reads_it_and_zeroed(
    monkeypatch, dtype, avx512, in_place
):
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: avx512)
    config = tiny_configs()["llama-gqa4-llama3-rope"]
    caches, zeroing = allocate_kv_caches(config, 6, 4, dtype, torch.device("cpu"))
    zeroing.join()
    assert len(caches) == config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    for key_cache, value_cache in caches:
        for cache in (key_cache, value_cache):
            assert cache.shape == (6, 4, config.num_key_value_heads, head_dim)
            assert not cache.any()
        # Read in place: a key block's slots of one component are a run; otherwise a kv
        # head's slots of a block. Each value's head is a run.
        key_order = (0, 2, 3, 1) if in_place else (0, 2, 1, 3)
        assert key_cache.permute(key_order).is_contiguous()
        assert value_cache.permute(0, 2, 1, 3).is_contiguous()
        assert reads_in_place(key_cache, value_cache, dtype) == in_place


# In a process of its own: memory that earlier tests freed may be handed out again
# already resident, and then the pool's pages would count as mapped without being written.
_POOL_RESIDENCY = """
import psutil, torch
from aioserve.runner.kv_memory import allocate_kv_caches
from tests.models.tiny_models import tiny_configs

config = tiny_configs()["llama-gqa4-llama3-rope"]
head_dim = config.hidden_size // config.num_attention_heads
block_bytes = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
num_blocks = (96 << 20) // block_bytes
resident_before = psutil.Process().memory_info().rss
caches, zeroing = allocate_kv_caches(config, num_blocks, 16, torch.float32, torch.device("cpu"))
zeroing.join()
grown = psutil.Process().memory_info().rss - resident_before
print(grown, num_blocks * block_bytes)
"""


def _numbers_printed_by(script: str) -> list[int]:
    """Run `script` in a Python of its own, from the repository's root: the integers it printed."""
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        preexec_fn=die_with_parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [int(word) for word in run.stdout.split()]


def test_every_page_of_the_cpu_pool_is_in_memory_once_the_thread_is_done():
    # A pool the machine cannot hold must fail at start, not under load: the kernel maps
    # a page in only when it is first written, so the zeroing has to reach every page.
    grown, pool_bytes = _numbers_printed_by(_POOL_RESIDENCY)
    assert grown >= 0.95 * pool_bytes


# torch puts tensors of 2 MiB and more on huge pages when THP_MEM_ALLOC_ENABLE is set, as
# the CLI sets it. A plain tensor of the pool's size, zeroed after it, shows whether this
# host gives huge pages at all.
_POOL_PAGES = """
import os
os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
import torch
from aioserve.runner.kv_memory import allocate_kv_caches
from tests.models.tiny_models import tiny_configs

def huge_bytes():
    with open("/proc/self/smaps_rollup") as rollup:
        line = next(line for line in rollup if line.startswith("AnonHugePages:"))
    return int(line.split()[1]) * 1024

config = tiny_configs()["llama-gqa4-llama3-rope"]
head_dim = config.hidden_size // config.num_attention_heads
block_bytes = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
num_blocks = (96 << 20) // block_bytes
before = huge_bytes()
caches, zeroing = allocate_kv_caches(config, num_blocks, 16, torch.float32, torch.device("cpu"))
zeroing.join()
pool = huge_bytes() - before
before = huge_bytes()
plain_tensor = torch.empty(num_blocks * block_bytes, dtype=torch.uint8).zero_()
plain = huge_bytes() - before
print(pool, plain, num_blocks * block_bytes)
"""


def test_the_cpu_pool_is_on_small_pages_where_other_tensors_get_huge_ones():
    # Under KVM, the first touch of 4 GiB on huge pages took 7.6-9.6 s on one core where
    # 4 KiB pages took 1.4-1.9 s, and it was the last thing before ready (RESULTS).
    pool, plain, pool_bytes = _numbers_printed_by(_POOL_PAGES)
    if plain < pool_bytes // 2:
        pytest.skip(f"this host gave a plain tensor {plain} bytes of huge pages, of {pool_bytes}")
    assert pool < pool_bytes // 10


def test_joining_the_zeroing_zeroes_what_its_thread_has_not_reached(monkeypatch):
    # The start-up joins once the compile is done, and then lends its own cores.
    monkeypatch.setattr(KVZeroing, "_zero_on_one_core", lambda self: None)
    caches = [torch.ones(1000) for _ in range(5)]
    KVZeroing(caches).join()
    assert not any(cache.any() for cache in caches)
