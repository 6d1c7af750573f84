"""vLLM 0.32's ObservabilityConfig flags aioserve implements: checked at start-up, and what
the engine makes of them (engine/step_observation.py)."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import LlamaConfig

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.config.parser import add_engine_arguments
from aioserve.engine.step_observation import observability_settings
from aioserve.runner.cudagraph_stats import CUDAGraphSettings

NO_GRAPHS = CUDAGraphSettings()


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(["--model", "m", *argv]))


@pytest.mark.parametrize("sample", ["0", "-0.5", "1.01", "nan", "often"])
def test_a_sample_rate_outside_zero_to_one_is_refused_by_name(sample):
    with pytest.raises(ConfigError, match="--kv-cache-metrics-sample"):
        _config("--kv-cache-metrics", "--kv-cache-metrics-sample", sample)


def test_the_llm_keywords_are_checked_too():
    with pytest.raises(ConfigError, match="^kv_cache_metrics_sample must be a number"):
        engine_config_from_kwargs(model="m", kv_cache_metrics_sample=2)
    config = engine_config_from_kwargs(model="m", enable_mfu_metrics=True)
    assert config.observability.enable_mfu_metrics is True


def test_the_flags_reach_the_engine_only_when_set():
    hf = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10)
    off = observability_settings(
        _config().observability, hf, torch.float16, torch.float16, None, NO_GRAPHS
    )
    assert (
        off.kv_cache_metrics_sample,
        off.mfu_model,
        off.iteration_details,
        off.cudagraphs,
    ) == (None, None, False, None)
    assert not off.observes_steps
    on = observability_settings(
        _config(
            "--kv-cache-metrics",
            "--kv-cache-metrics-sample",
            "0.25",
            "--enable-mfu-metrics",
            "--enable-logging-iteration-details",
        ).observability,
        hf,
        torch.float16,
        torch.float8_e4m3fn,
        None,
        NO_GRAPHS,
    )
    assert on.kv_cache_metrics_sample == 0.25 and on.iteration_details and on.observes_steps
    assert on.mfu_model is not None
    assert (on.mfu_model.activation_bytes, on.mfu_model.cache_bytes) == (2, 1)
    # The sample rate alone does not turn the residency metrics on, as in vLLM.
    rate_only = _config("--kv-cache-metrics-sample", "0.5").observability
    assert (
        observability_settings(
            rate_only, hf, torch.float16, torch.float16, None, NO_GRAPHS
        ).kv_cache_metrics_sample
        is None
    )


def test_cudagraph_metrics_keep_the_runners_graph_settings():
    hf = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10)
    graphs = CUDAGraphSettings("FULL_DECODE_ONLY", (1, 2, 4))
    on = observability_settings(
        _config("--cudagraph-metrics").observability, hf, torch.float16, torch.float16, None, graphs
    )
    assert on.cudagraphs is graphs and on.observes_steps
    assert on.mfu_model is None and not on.iteration_details
