"""/metrics and the stats line for --kv-cache-metrics, --enable-mfu-metrics and
--enable-logging-iteration-details, read back with prometheus-client's parser.

The families' names, types, help texts and buckets are checked against vLLM 0.32's own
(its /metrics page for the FLOP counters, v1/metrics/loggers.py and buckets.py for the
residency histograms, copied here). A stand-in engine runs steps whose shapes are known by
hand: one 20-token prompt, then decodes at contexts 21 to 24.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from aioserve import SamplingParams
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.kv_residency import ResidencySample
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.engine.step_observation import ObservabilitySettings
from aioserve.engine.step_perf import ModelShape, StepPerf, StepShape
from aioserve.runner.stand_in_runner import StandInRunner
from aioserve.server.metrics import PrometheusStatLogger
from aioserve.server.stats_log import StatsLine
from tests.server.metrics_steps import MODEL, exposition, families, step, value

VLLM_METRICS = Path(__file__).parent / "vllm_samples" / "24_metrics.txt"
RESIDENCY = (
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
)
# vLLM 0.32's KV_CACHE_RESIDENCY_BUCKETS (v1/metrics/buckets.py).
VLLM_RESIDENCY_BUCKETS = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
]  # fmt: skip
ESTIMATED = (
    "vllm:estimated_flops_per_gpu",
    "vllm:estimated_read_bytes_per_gpu",
    "vllm:estimated_write_bytes_per_gpu",
)


def _bounds(family) -> list[float]:
    return [
        float(s.labels["le"])
        for s in family.samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]


def test_flop_counters_are_vllms_and_always_on_the_page():
    vllm = families(VLLM_METRICS.read_text())
    ours = exposition(PrometheusStatLogger(MODEL, max_model_len=2048))
    for name in ESTIMATED:
        assert ours[name].type == vllm[name].type == "counter"
        assert ours[name].documentation == vllm[name].documentation
        (sample,) = [s for s in ours[name].samples if s.name.endswith("_total")]
        assert sample.labels == {"model_name": MODEL, "engine": "0"}
        assert sample.value == 0.0
    assert not any(name in ours for name in RESIDENCY)  # only with --kv-cache-metrics


def test_residency_histograms_are_vllms_and_observe_each_sample():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048, kv_cache_metrics=True)
    samples = [
        ResidencySample(2.5, 0.004, (0.5, 0.25, 0.003)),
        ResidencySample(700.0, 650.0, ()),
        ResidencySample(0.0015, 0.0015, (0.0001,)),
    ]
    stat_logger.record(step(kv_block_residency=samples[:2]))
    stat_logger.record(step(kv_block_residency=samples[2:]))
    ours = exposition(stat_logger)
    for name in RESIDENCY:
        assert ours[name].type == "histogram"
        assert ours[name].documentation.endswith(
            "Sampled metrics (controlled by --kv-cache-metrics-sample)."
        )
        assert _bounds(ours[name]) == VLLM_RESIDENCY_BUCKETS
    assert value(ours, "vllm:kv_block_lifetime_seconds_count") == 3
    assert value(ours, "vllm:kv_block_lifetime_seconds_sum") == pytest.approx(702.5015)
    assert value(ours, "vllm:kv_block_lifetime_seconds_bucket", le="600.0") == 2
    assert value(ours, "vllm:kv_block_idle_before_evict_seconds_bucket", le="0.002") == 1
    assert value(ours, "vllm:kv_block_idle_before_evict_seconds_bucket", le="0.005") == 2
    assert value(ours, "vllm:kv_block_reuse_gap_seconds_count") == 4
    assert value(ours, "vllm:kv_block_reuse_gap_seconds_bucket", le="0.001") == 1
    assert value(ours, "vllm:kv_block_reuse_gap_seconds_sum") == pytest.approx(0.7531)


def test_custom_buckets_apply_to_the_residency_family():
    stat_logger = PrometheusStatLogger(
        MODEL,
        max_model_len=2048,
        kv_cache_metrics=True,
        custom_buckets={"kv_cache_residency": [0.5, 5.0]},
    )
    ours = exposition(stat_logger)
    for name in RESIDENCY:
        assert _bounds(ours[name]) == [0.5, 5.0]
    assert _bounds(ours["vllm:iteration_tokens_total"])[0] == 1.0  # other families keep theirs


def test_flop_counters_add_each_steps_estimate():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    stat_logger.record(step(perf=StepPerf(1_000, 200, 30)))
    stat_logger.record(step(perf=StepPerf(2_000, 400, 60)))
    stat_logger.record(step())  # a step without an estimate (an abort)
    ours = exposition(stat_logger)
    assert value(ours, "vllm:estimated_flops_per_gpu_total") == 3_000
    assert value(ours, "vllm:estimated_read_bytes_per_gpu_total") == 600
    assert value(ours, "vllm:estimated_write_bytes_per_gpu_total") == 90


def test_stats_line_logs_mfu_over_the_interval(caplog):
    line = StatsLine("GPU", now=0.0)
    line.record(step(perf=StepPerf(3 * 10**12, 10**9, 10**9), num_generation_tokens=1))
    with caplog.at_level(logging.INFO, logger="aioserve.stats"):
        line.log(now=2.0)
        line.log(now=4.0)  # nothing counted since: no MFU line
    mfu = [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()]
    assert mfu == ["Engine 000: MFU: 1.5 TF/s/device 1.0 GB/s/device"]


# -- a stand-in engine ----------------------------------------------------------------------

TINY = LlamaConfig(
    num_hidden_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    vocab_size=64,
)


def _engine(
    observability: ObservabilitySettings, num_blocks: int = 64, async_scheduling: bool = False
) -> AsyncEngine:
    parts = engine_parts_around(
        StandInRunner(64),
        vocab_size=64,
        num_blocks=num_blocks,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    parts.settings.observability = observability
    return AsyncEngine(parts)


async def _generate(engine: AsyncEngine, prompt: list[int], max_tokens: int, rid: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for _ in engine.generate({"prompt_token_ids": prompt}, params, rid):
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engines_steps_are_estimated_and_logged_as_vllm_logs_them(caplog, async_scheduling):
    # With asynchronous scheduling the first decode is launched before the prompt's token
    # reaches the host: it is still a generation step.
    shape = ModelShape.from_config(TINY, torch.float32, torch.float32)
    settings = ObservabilitySettings(mfu_model=shape, iteration_details=True)
    engine = _engine(settings, async_scheduling=async_scheduling)
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=256)
    engine.stat_loggers.extend([stat_logger, StatsLine("CPU")])

    async def scenario():
        try:
            await _generate(engine, list(range(1, 21)), 5, "a")
        finally:
            await engine.shutdown()

    with caplog.at_level(logging.INFO, logger="aioserve.stats"):
        asyncio.run(asyncio.wait_for(scenario(), 60))
    # By hand: a 20-token prefill, then four one-token decodes at contexts 21..24.
    steps = [StepShape([(20, 20, True)])] + [StepShape([(1, c, False)]) for c in range(21, 25)]
    expected = [shape.estimate(s) for s in steps]
    ours = exposition(stat_logger)
    assert value(ours, "vllm:estimated_flops_per_gpu_total") == sum(e.flops for e in expected)
    assert value(ours, "vllm:estimated_read_bytes_per_gpu_total") == sum(
        e.read_bytes for e in expected
    )
    assert value(ours, "vllm:estimated_write_bytes_per_gpu_total") == sum(
        e.write_bytes for e in expected
    )
    lines = [r.getMessage() for r in caplog.records if "Iteration(" in r.getMessage()]
    assert len(lines) == 5
    assert lines[0].startswith(
        "Engine 000: Iteration(0): 1 context requests, 20 context tokens, 0 generation "
        "requests, 0 generation tokens, iteration elapsed time: "
    )
    for i, line in enumerate(lines[1:], start=1):
        assert f"Iteration({i}): 0 context requests, 0 context tokens, 1 generation " in line
        assert "1 generation tokens" in line and line.endswith("%") and "CPU KV cache usage" in line


def test_an_engines_evicted_blocks_reach_the_residency_histograms():
    engine = _engine(ObservabilitySettings(kv_cache_metrics_sample=1.0), num_blocks=8)
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=256, kv_cache_metrics=True)
    engine.stat_loggers.append(stat_logger)
    shared = list(range(1, 33))  # two full blocks of 16

    async def scenario():
        try:
            for i in range(6):  # the shared prefix hits; the tails evict each other's blocks
                await _generate(engine, shared + [40 + i] * 40, 2, f"r{i}")
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    ours = exposition(stat_logger)
    evicted = value(ours, "vllm:kv_block_lifetime_seconds_count")
    assert evicted > 0
    assert value(ours, "vllm:kv_block_idle_before_evict_seconds_count") == evicted
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
