"""--kv-cache-memory-bytes (vLLM 0.32's): the KV pool takes the bytes it names, in vLLM's
human-readable forms, on the CPU instead of VLLM_CPU_KVCACHE_SPACE's default; the variable,
set, still wins there (vLLM 0.32's CPU platform); bad sizes are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from aioserve import LLM
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import CPU_KVCACHE_SPACE_ENV, engine_config_from_kwargs
from aioserve.runner.kv_memory import kv_cache_bytes_per_block
from tests.models.tiny_models import save_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


def _blocks(folder, **more) -> tuple[int, str]:
    with LLM(
        model=str(folder), dtype="float32", max_model_len=64, block_size=16,
        skip_tokenizer_init=True, enforce_eager=True, **more,
    ) as llm:  # fmt: skip
        settings = llm.engine.settings
        return settings.num_blocks, settings.load_report.kv_cache_sized_by


@pytest.mark.parametrize(("size", "nbytes"), [("1M", 2**20), ("3.2m", 3_200_000), (65536, 65536)])
def test_the_pool_holds_the_bytes_named(llama_folder, monkeypatch, size, nbytes):
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    per_block = kv_cache_bytes_per_block(tiny_llama_config(), 16, torch.float32)
    blocks, sized_by = _blocks(llama_folder, kv_cache_memory_bytes=size)
    assert blocks == nbytes // per_block
    assert sized_by.startswith("--kv-cache-memory-bytes (")


def test_the_variable_wins_on_the_cpu(llama_folder, monkeypatch):
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.0625")  # 64 MiB
    per_block = kv_cache_bytes_per_block(tiny_llama_config(), 16, torch.float32)
    blocks, sized_by = _blocks(llama_folder, kv_cache_memory_bytes="1M")
    assert blocks == 2**26 // per_block
    assert sized_by == "VLLM_CPU_KVCACHE_SPACE (0.0625 GiB)"


@pytest.mark.parametrize("size", ["0", "1.5K", "lots", "-4G"])
def test_bad_sizes_are_refused_naming_the_flag(size):
    with pytest.raises(ConfigError, match="kv.cache.memory.bytes"):
        engine_config_from_kwargs(model="m", kv_cache_memory_bytes=size)
