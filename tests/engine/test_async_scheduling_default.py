"""--async-scheduling: honoured when given; otherwise on for a GPU, off for the CPU, and the
engine's settings and start-up log say which. The same log line gives the step limits."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aioserve import AsyncEngine
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.resolution import resolve_async_scheduling


@pytest.mark.parametrize(
    "requested, platform, expected",
    [
        (None, "cpu", False),
        (None, "cuda", True),
        (None, "rocm", True),
        (True, "cpu", True),
        (False, "cuda", False),
    ],
)
def test_resolve_async_scheduling(requested, platform, expected):
    assert resolve_async_scheduling(requested, platform) is expected


def test_cpu_engine_defaults_to_no_overlap_and_logs_it(smollm2_gguf, caplog):
    caplog.set_level(logging.INFO, logger="aioserve")
    engine = AsyncEngine.from_config(
        engine_config_from_kwargs(model=str(smollm2_gguf), max_model_len=256, enforce_eager=True)
    )
    try:
        assert engine.settings.async_scheduling is False
        assert "asynchronous scheduling off" in caplog.text
        # The offline engine's step limits are vLLM-CPU's LLM class's (`serve` takes its
        # server's, 128 and 2048: test_serve_command.py).
        assert engine.settings.max_num_seqs == 256
        assert engine.settings.max_num_batched_tokens == 4096
        assert "up to 256 sequences and 4096 tokens a step" in caplog.text
    finally:
        asyncio.run(engine.shutdown())
