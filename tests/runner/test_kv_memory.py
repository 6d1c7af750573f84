"""The KV pool as the runner allocates it: on the CPU stored head-major and zeroed."""

from __future__ import annotations

import torch

from aioserve.runner.kv_memory import allocate_kv_caches
from tests.models.tiny_models import tiny_configs


def test_the_cpu_pool_is_head_major_and_zeroed():
    config = tiny_configs()["llama-gqa4-llama3-rope"]
    caches, zeroing = allocate_kv_caches(config, 6, 4, torch.bfloat16, torch.device("cpu"))
    zeroing.join()
    assert len(caches) == config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    for key_cache, value_cache in caches:
        for cache in (key_cache, value_cache):
            assert cache.shape == (6, 4, config.num_key_value_heads, head_dim)
            # A kv head's slots of a block are one run of memory (kernels/kv_cache.py).
            assert cache.permute(0, 2, 1, 3).is_contiguous()
            assert not cache.any()
