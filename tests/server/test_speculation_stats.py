"""Speculative decoding's statistics without a model: vLLM's counters on /metrics and its
"SpecDecoding metrics" log line, from the per-step counts the engine reports."""

from __future__ import annotations

import logging
import re

from aioserve.engine.stats import SpeculationCounts
from aioserve.server.metrics import PrometheusStatLogger
from aioserve.server.stats_log import StatsLine
from tests.server.metrics_steps import exposition, step, value

MODEL = "m"
STEPS = [
    step(1.0, num_generation_tokens=7, speculation=SpeculationCounts(2, 8, 5, (2, 2, 1, 0))),
    step(2.0, num_generation_tokens=2, speculation=SpeculationCounts(0, 0, 0, (0, 0, 0, 0))),
    step(3.0, num_generation_tokens=5, speculation=SpeculationCounts(1, 4, 4, (1, 1, 1, 1))),
]


def test_counters_add_up_each_steps_counts():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048, num_speculative_tokens=4)
    for stats in STEPS:
        stat_logger.record(stats)
    m = exposition(stat_logger)
    assert value(m, "vllm:spec_decode_num_drafts_total", model_name=MODEL, engine="0") == 3
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == 12
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 9
    per_position = [
        value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(4)
    ]
    assert per_position == [3, 3, 2, 1]


def test_without_speculation_there_are_no_counters():
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    stat_logger.record(step(1.0))
    assert not any(name.startswith("vllm:spec_decode") for name in exposition(stat_logger))


SPEC_LINE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: (\S+), Accepted throughput: (\S+) "
    r"tokens/s, Drafted throughput: (\S+) tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) "
    r"tokens, Per-position acceptance rate: (.+), Avg Draft acceptance rate: (\S+)%"
)


def test_the_log_line_is_vllms_and_follows_the_stats_line(caplog):
    caplog.set_level(logging.INFO, logger="aioserve.stats")
    line = StatsLine("CPU", now=0.0)
    for stats in STEPS:
        line.record(stats)
    line.log(now=10.0)
    engine_line, spec_line = (r.getMessage() for r in caplog.records)
    assert engine_line.startswith("Engine 000:")
    assert SPEC_LINE.fullmatch(spec_line).groups() == (
        "4.00",  # 1 + 9 accepted / 3 drafts
        "0.90",
        "1.20",
        "9",
        "12",
        "1.000, 1.000, 0.667, 0.333",
        "75.0",
    )
    # Nothing drafted in the next interval: no second line.
    caplog.clear()
    line.record(STEPS[1])
    line.log(now=20.0)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Engine 000"]
