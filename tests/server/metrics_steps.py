"""Hand-made engine steps for the metrics tests, and readers of an exposition.

PREFILL_STEP then DECODE_STEP are two steps whose metrics are worked out by hand
(test_metrics.py checks them); `families` and `value` read a /metrics page back with
prometheus-client's own parser.
"""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aioserve.engine.stats import FinishedRequestStats, StepStats
from aioserve.server.metrics import PrometheusStatLogger

MODEL = "m"


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def exposition(stat_logger: PrometheusStatLogger) -> dict:
    return families(generate_latest(stat_logger.registry).decode())


def value(fams: dict, sample_name: str, **labels: str) -> float:
    """The one sample called `sample_name` whose labels include `labels`."""
    family_name = re.sub(r"_(total|bucket|count|sum)$", "", sample_name)
    family = fams.get(family_name) or fams[sample_name]
    found = [
        s.value
        for s in family.samples
        if s.name == sample_name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (sample_name, labels, found)
    return found[0]


def step(timestamp: float = 0.0, **fields) -> StepStats:
    defaults = dict(
        num_prompt_tokens=0,
        num_generation_tokens=0,
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    return StepStats(timestamp=timestamp, **{**defaults, **fields})


def finished(**fields) -> FinishedRequestStats:
    defaults = dict(
        finish_reason="length",
        num_prompt_tokens=1,
        num_generation_tokens=1,
        max_tokens_param=None,
        max_num_generation_tokens=1,
        n=1,
        num_cached_tokens=0,
        num_preemptions=0,
        e2e_latency=0.0,
        queued_time=0.0,
        prefill_time=0.0,
        decode_time=0.0,
        inference_time=0.0,
        mean_time_per_output_token=0.0,
    )
    return FinishedRequestStats(**{**defaults, **fields})


# Two steps whose metrics are worked out by hand in test_known_steps_give_known_metrics.
PREFILL_STEP = step(
    100.0,
    num_prompt_tokens=12,
    num_generation_tokens=2,
    num_running=2,
    num_waiting=1,
    kv_cache_usage=0.25,
    num_preemptions=1,
    prefix_cache_queries=16,
    prefix_cache_hits=8,
    num_cached_prompt_tokens=8,
    time_to_first_tokens=[0.03, 0.3],
)
DECODE_STEP = step(
    100.4,
    num_generation_tokens=3,
    inter_token_latencies=[0.02, 0.02, 0.2],
    finished=[
        finished(
            finish_reason="length",
            num_prompt_tokens=7,
            num_generation_tokens=4,
            max_tokens_param=4,
            max_num_generation_tokens=4,
            num_preemptions=1,
            e2e_latency=0.9,
            queued_time=0.1,
            prefill_time=0.2,
            decode_time=0.6,
            inference_time=0.8,
            mean_time_per_output_token=0.2,
        ),
        finished(
            finish_reason="stop",
            num_prompt_tokens=5,
            num_generation_tokens=3,
            max_num_generation_tokens=100,
            n=2,
            num_cached_tokens=4,
            e2e_latency=2.0,
            queued_time=1.2,
            prefill_time=0.3,
            decode_time=0.5,
            inference_time=0.8,
        ),
    ],
)
