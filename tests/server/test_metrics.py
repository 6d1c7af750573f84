"""Prometheus metrics and the stats line, checked against vLLM's own /metrics page.

Unit tests feed hand-made StepStats to the loggers and read the exposition back with
prometheus-client's parser; the reference for names, types, help texts and buckets is the
/metrics page of a real vLLM 0.32 (vllm_samples/24_metrics.txt, copied from
shared/reference/). The hand-made steps are in metrics_steps.py; test_metrics_scraping.py
scrapes /metrics as Prometheus does. One end-to-end test serves /metrics over HTTP in front
of a real engine on the default model.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from aioserve import SamplingParams
from aioserve.server.errors import error_middleware
from aioserve.server.metrics import (
    PrometheusStatLogger,
    add_metrics,
    cache_config_labels,
    monitor_event_loop_lag,
)
from aioserve.server.state import STATE, ServerState
from aioserve.server.stats_log import StatsLine
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import fail_model_step
from tests.server.metrics_steps import (
    DECODE_STEP,
    MODEL,
    PREFILL_STEP,
    exposition,
    families,
    step,
    value,
)

VLLM_METRICS = Path(__file__).parent / "vllm_samples" / "24_metrics.txt"


@pytest.fixture(scope="module")
def vllm_families() -> dict:
    return families(VLLM_METRICS.read_text())


def test_every_exposed_metric_has_vllms_name_and_type(vllm_families):
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048, cache_config={})
    ours = exposition(stat_logger)
    for name, family in ours.items():
        if name.startswith("aioserve:"):
            continue
        assert name in vllm_families, f"{name} is not on vLLM's /metrics page"
        assert family.type == vllm_families[name].type, name
        assert family.documentation == vllm_families[name].documentation, name


def test_the_metrics_the_engine_can_measure_are_all_exposed():
    ours = exposition(PrometheusStatLogger(MODEL, max_model_len=2048, cache_config={}))
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:request_num_preemptions": "histogram",
        "vllm:request_prefill_kv_computed_tokens": "histogram",
        "aioserve:event_loop_lag_seconds": "histogram",
        "aioserve:engine_step_duration_seconds": "histogram",
    }
    assert {name: ours[name].type for name in expected if name in ours} == expected


def test_histogram_buckets_are_vllms(vllm_families):
    # vLLM's capture ran with max_model_len 2048: token-count buckets stop at 2000.
    ours = exposition(PrometheusStatLogger(MODEL, max_model_len=2048))

    def bounds(family) -> list[str]:
        return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]

    histograms = [f for f in ours.values() if f.type == "histogram" and f.name.startswith("vllm:")]
    assert len(histograms) == 16
    for family in histograms:
        assert bounds(family) == bounds(vllm_families[family.name]), family.name


def test_token_buckets_follow_max_model_len():
    ours = exposition(PrometheusStatLogger(MODEL, max_model_len=512))
    les = [
        s.labels["le"]
        for s in ours["vllm:request_prompt_tokens"].samples
        if s.name.endswith("_bucket")
    ]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]


def test_known_steps_give_known_metrics():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    stat_logger.record(PREFILL_STEP)
    stat_logger.record(DECODE_STEP)
    m = exposition(stat_logger)

    assert value(m, "vllm:prompt_tokens_total") == 12 + 8  # computed and from the cache
    assert value(m, "vllm:generation_tokens_total") == 5
    assert value(m, "vllm:num_preemptions_total") == 1
    assert value(m, "vllm:prefix_cache_queries_total") == 16
    assert value(m, "vllm:prefix_cache_hits_total") == 8
    # Gauges show the state after the latest step.
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0

    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 0

    # Iteration tokens: 14 and 3.
    assert value(m, "vllm:iteration_tokens_total_count") == 2
    assert value(m, "vllm:iteration_tokens_total_sum") == 17
    assert value(m, "vllm:iteration_tokens_total_bucket", le="1.0") == 0
    assert value(m, "vllm:iteration_tokens_total_bucket", le="8.0") == 1
    assert value(m, "vllm:iteration_tokens_total_bucket", le="16.0") == 2
    # TTFT 0.03 and 0.3.
    assert value(m, "vllm:time_to_first_token_seconds_count") == 2
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.33)
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 2
    # ITL 0.02, 0.02, 0.2.
    assert value(m, "vllm:inter_token_latency_seconds_count") == 3
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.24)
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.15") == 2
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.2") == 3

    # Per request: the two finished requests.
    assert value(m, "vllm:request_prompt_tokens_count") == 2
    assert value(m, "vllm:request_prompt_tokens_sum") == 12
    assert value(m, "vllm:request_prompt_tokens_bucket", le="5.0") == 1
    assert value(m, "vllm:request_generation_tokens_sum") == 7
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 104
    assert value(m, "vllm:request_max_num_generation_tokens_bucket", le="100.0") == 2
    assert value(m, "vllm:request_params_n_sum") == 3
    assert value(m, "vllm:request_params_n_bucket", le="1.0") == 1
    # Only the request that sent max_tokens is counted.
    assert value(m, "vllm:request_params_max_tokens_count") == 1
    assert value(m, "vllm:request_params_max_tokens_sum") == 4
    assert value(m, "vllm:request_num_preemptions_sum") == 1
    assert value(m, "vllm:request_num_preemptions_bucket", le="1.0") == 2
    # 7 - 0 and 5 - 4 prompt tokens computed.
    assert value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 8
    assert value(m, "vllm:request_prefill_kv_computed_tokens_bucket", le="1.0") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.9)
    assert value(m, "vllm:e2e_request_latency_seconds_bucket", le="1.0") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_bucket", le="2.0") == 2
    assert value(m, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.3)
    assert value(m, "vllm:request_queue_time_seconds_bucket", le="0.3") == 1
    assert value(m, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value(m, "vllm:request_decode_time_seconds_sum") == pytest.approx(1.1)
    assert value(m, "vllm:request_inference_time_seconds_sum") == pytest.approx(1.6)
    # The request with one token per sample counts 0 s per output token, as in vLLM.
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 2
    assert value(m, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "vllm:request_time_per_output_token_seconds_bucket", le="0.01") == 1

    # Requests were pending after the first step, so the second one lasted 0.4 s.
    assert value(m, "aioserve:engine_step_duration_seconds_count") == 1
    assert value(m, "aioserve:engine_step_duration_seconds_sum") == pytest.approx(0.4)


def test_every_series_carries_model_name_and_engine():
    stat_logger = PrometheusStatLogger("org/model-7b", max_model_len=2048, cache_config={})
    stat_logger.record(PREFILL_STEP)
    stat_logger.record(DECODE_STEP)
    for family in exposition(stat_logger).values():
        if family.name == "vllm:cache_config_info" or not family.name.startswith("vllm:"):
            continue
        assert family.samples, family.name
        for sample in family.samples:
            assert sample.labels["model_name"] == "org/model-7b", sample
            assert sample.labels["engine"] == "0", sample
    lag = exposition(stat_logger)["aioserve:event_loop_lag_seconds"]
    assert all(s.labels["model_name"] == "org/model-7b" for s in lag.samples)


def test_cache_config_info_matches_vllms_for_the_same_cache(vllm_families):
    # vLLM's capture: 1456 blocks of 128 tokens, max_model_len 2048, prefix caching on.
    settings = SimpleNamespace(
        max_model_len=2048,
        block_size=128,
        num_blocks=1456,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
    )
    stat_logger = PrometheusStatLogger(
        MODEL, max_model_len=2048, cache_config=cache_config_labels(settings)
    )
    (ours,) = exposition(stat_logger)["vllm:cache_config_info"].samples
    (theirs,) = vllm_families["vllm:cache_config_info"].samples
    assert ours.value == theirs.value == 1
    assert ours.labels == {name: theirs.labels[name] for name in ours.labels}
    assert set(ours.labels) == {
        "engine",
        "block_size",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "num_gpu_blocks",
        "kv_cache_size_tokens",
        "kv_cache_max_concurrency",
    }


def test_step_duration_skips_idle_gaps():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    busy = dict(num_generation_tokens=1, num_running=1)
    stat_logger.record(step(10.0, **busy))
    stat_logger.record(step(10.5, **busy))  # one step: 0.5 s
    stat_logger.record(step(10.7, num_generation_tokens=1))  # 0.2 s; nothing pending after
    stat_logger.record(step(50.0, **busy))  # after an idle gap: not a step duration
    stat_logger.record(step(50.1))  # an abort that leaves the engine idle
    stat_logger.record(step(90.0, **busy))  # again after an idle gap
    m = exposition(stat_logger)
    assert value(m, "aioserve:engine_step_duration_seconds_count") == 2
    assert value(m, "aioserve:engine_step_duration_seconds_sum") == pytest.approx(0.7)


def test_host_gaps_are_a_histogram_of_the_steps_that_had_one():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    stat_logger.record(step(1.0, num_generation_tokens=1, num_running=1))  # after idle: none
    stat_logger.record(step(1.1, num_generation_tokens=1, num_running=1, host_gap=0.0003))
    stat_logger.record(step(1.2, num_generation_tokens=1, num_running=1, host_gap=0.02))
    m = exposition(stat_logger)
    assert value(m, "aioserve:host_gap_seconds_count") == 2
    assert value(m, "aioserve:host_gap_seconds_sum") == pytest.approx(0.0203)
    assert value(m, "aioserve:host_gap_seconds_bucket", le="0.0005") == 1


def test_event_loop_lag_monitor_sees_a_blocked_loop():
    lags: list[float] = []

    async def scenario():
        monitor = asyncio.create_task(monitor_event_loop_lag(lags.append, interval=0.05))
        await asyncio.sleep(0)  # the monitor starts its first sleep
        time.sleep(0.3)  # hold the loop: the monitor wakes at least 0.25 s late
        await asyncio.sleep(0.1)
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert lags and max(lags) >= 0.25
    assert min(lags) >= 0.0

    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    for lag in lags:
        stat_logger.observe_event_loop_lag(lag)
    m = exposition(stat_logger)
    assert value(m, "aioserve:event_loop_lag_seconds_count") == len(lags)
    assert value(m, "aioserve:event_loop_lag_seconds_sum") == pytest.approx(sum(lags))
    assert value(m, "aioserve:event_loop_lag_seconds_bucket", le="0.1") <= len(lags) - 1


STATS_LINE = re.compile(
    r"Engine 000: Avg prompt throughput: (\S+) tokens/s, Avg generation throughput: (\S+) "
    r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, CPU KV cache usage: (\S+)%, "
    r"Prefix cache hit rate: (\S+)%, Host gap: (\S+) ms/step"
)


def test_stats_line_reports_throughput_and_engine_state(caplog):
    caplog.set_level(logging.DEBUG, logger="aioserve.stats")
    line = StatsLine("CPU", now=0.0)
    line.record(PREFILL_STEP)  # 12 prompt tokens, 2 generated; 2 running, 1 waiting
    line.record(step(4.0, num_generation_tokens=9, host_gap=0.001))
    line.record(
        step(5.0, num_generation_tokens=9, num_running=2, kv_cache_usage=0.125, host_gap=0.004)
    )
    line.log(now=10.0)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert STATS_LINE.fullmatch(record.getMessage()).groups() == (
        "1.2",
        "2.0",
        "2",
        "0",
        "12.5",
        "50.0",
        "2.50",  # the mean host gap of the steps that had one
    )


def test_stats_line_goes_quiet_once_the_engine_is_idle(caplog):
    caplog.set_level(logging.DEBUG, logger="aioserve.stats")
    line = StatsLine("CPU", now=0.0)
    line.record(step(1.0, num_prompt_tokens=40, num_running=1))
    line.log(now=10.0)  # activity
    line.record(step(11.0, num_generation_tokens=1))  # the request ends
    line.log(now=20.0)  # activity in this interval
    line.log(now=30.0)  # nothing now, but throughput in the previous interval
    line.log(now=40.0)  # idle: debug only
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.INFO, logging.INFO, logging.DEBUG]
    throughputs = [STATS_LINE.fullmatch(r.getMessage()).group(1, 2) for r in caplog.records]
    assert throughputs == [("4.0", "0.0"), ("0.0", "0.1"), ("0.0", "0.0"), ("0.0", "0.0")]


def test_stats_line_is_logged_periodically(caplog):
    caplog.set_level(logging.INFO, logger="aioserve.stats")
    line = StatsLine("CPU")
    line.record(step(time.monotonic(), num_prompt_tokens=10, num_running=1, num_waiting=3))

    async def scenario():
        task = asyncio.create_task(line.run(interval=0.05))
        try:
            while not caplog.records:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    groups = STATS_LINE.fullmatch(caplog.records[0].getMessage()).groups()
    assert groups[2:] == ("1", "3", "0.0", "0.0", "0.00")
    assert float(groups[0]) > 0


# -- end to end: a real engine behind /metrics ------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = float32_engine(smollm2_gguf, max_model_len=512)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.mark.slow
def test_metrics_endpoint_counts_real_requests(engine):
    prompts = {"a": "The capital of France is", "b": "One, two, three,"}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def generate(request_id: str, prompt: str):
        return [out async for out in engine.generate(prompt, params, request_id)][-1]

    async def scenario():
        app = web.Application(middlewares=[error_middleware])
        app[STATE] = ServerState(engine, [MODEL])
        add_metrics(app, app[STATE], stats_interval=10.0)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            assert len(engine.stat_loggers) == 2  # metrics and the stats line
            outputs = await asyncio.gather(*(generate(r, p) for r, p in prompts.items()))
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                    assert response.status == 200
                    content_type = response.headers["Content-Type"]
                    text = await response.text()
        finally:
            await runner.cleanup()
        return outputs, content_type, text

    outputs, content_type, text = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert engine.stat_loggers == []
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks

    assert content_type.startswith("text/plain; version=")
    m = families(text)
    prompt_lens = [len(engine.tokenizer(p).input_ids) for p in prompts.values()]
    assert [len(o.prompt_token_ids) for o in outputs] == prompt_lens
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert value(m, "vllm:prompt_tokens_total", model_name=MODEL) == sum(prompt_lens)
    assert value(m, "vllm:generation_tokens_total", model_name=MODEL) == 10
    assert value(m, "vllm:request_success_total", finished_reason="length") == 2
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(m, "vllm:request_prompt_tokens_sum") == sum(prompt_lens)
    assert value(m, "vllm:request_generation_tokens_sum") == 10
    assert value(m, "vllm:request_params_max_tokens_sum") == 10
    assert value(m, "vllm:iteration_tokens_total_sum") == sum(prompt_lens) + 10
    assert value(m, "vllm:time_to_first_token_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2 * 4
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(m, "aioserve:host_gap_seconds_count") >= 4  # every step after the first
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0
    (info,) = m["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == str(engine.settings.block_size)
    assert info.labels["num_gpu_blocks"] == str(engine.kv_cache.num_blocks)


@pytest.mark.slow
def test_a_failed_model_step_counts_its_requests_as_errors(engine, monkeypatch):
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=512)
    fail_model_step(monkeypatch, engine, on_call=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario():
        engine.stat_loggers.append(stat_logger)
        try:
            with pytest.raises(RuntimeError, match="injected step failure"):
                async for _ in engine.generate("Once upon a time", params, "doomed"):
                    pass
        finally:
            engine.stat_loggers.remove(stat_logger)

    asyncio.run(asyncio.wait_for(scenario(), 120))
    m = exposition(stat_logger)
    assert value(m, "vllm:request_success_total", finished_reason="error") == 1
    for reason in ("stop", "length", "abort"):
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(m, "vllm:num_requests_running") == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_prompt_tokens_count_the_ones_served_from_the_prefix_cache(engine):
    """vLLM's prompt tokens are every prompt token prefilled, computed or found in the
    prefix cache; its iteration tokens are the computed ones alone."""
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=512)
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # two full blocks of 16, and 8
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def scenario():
        assert engine.kv_cache.reset_prefix_cache()
        engine.stat_loggers.append(stat_logger)
        try:
            for request_id in ("first", "again"):
                async for _ in engine.generate(prompt, params, request_id):
                    pass
        finally:
            engine.stat_loggers.remove(stat_logger)

    asyncio.run(asyncio.wait_for(scenario(), 120))
    m = exposition(stat_logger)
    assert value(m, "vllm:prefix_cache_hits_total") == 32
    assert value(m, "vllm:prompt_tokens_total") == 80
    assert value(m, "vllm:iteration_tokens_total_sum") == 80 - 32 + 4


@pytest.mark.slow
def test_a_request_its_client_abandons_is_not_counted_as_finished(engine):
    """vLLM's abort (output_processor.abort_requests) records no per-request figures: a
    client that goes away moves neither request_success_total nor the latency histograms."""
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    async def scenario():
        engine.stat_loggers.append(stat_logger)
        try:
            async for output in engine.generate("Once upon a time", params, "abandoned"):
                if len(output.outputs[0].token_ids) >= 2:
                    break  # the generator's close aborts the request
            done = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            async for _ in engine.generate("Once upon a time", done, "finished"):
                pass
        finally:
            engine.stat_loggers.remove(stat_logger)

    asyncio.run(asyncio.wait_for(scenario(), 120))
    m = exposition(stat_logger)
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    for reason in ("stop", "abort", "error", "repetition"):
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(m, "vllm:request_generation_tokens_sum") == 3
    assert value(m, "vllm:num_requests_running") == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
