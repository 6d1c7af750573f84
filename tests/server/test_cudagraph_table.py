"""--cudagraph-metrics' table in the stats log (server/cudagraph_table.py, stats_log.py).

The expected text is written out by hand from vLLM 0.32's CUDAGraphLogging
(vllm/compilation/cuda_graph.py): its settings header, then a markdown table whose columns
are as wide as their widest cell, rows by descending count, ties in first-seen order.
"""

from __future__ import annotations

import logging

from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.server.cudagraph_table import CUDAGraphTable
from aioserve.server.stats_log import StatsLine
from tests.server.metrics_steps import step

SETTINGS = CUDAGraphSettings("FULL_DECODE_ONLY", (1, 2, 4, 8))
DECODE_3_OF_4 = CUDAGraphStat(3, 4, 1, "FULL")
PREFILL_20 = CUDAGraphStat(20, 20, 0, "NONE")

HEADER = (
    "**CUDAGraph Config Settings:**\n\n"
    "- Mode: FULL_DECODE_ONLY\n"
    "- Capture sizes: [1, 2, 4, 8]\n\n"
    "**CUDAGraph Stats:**\n\n"
)


def test_the_table_is_vllms_word_for_word():
    table = CUDAGraphTable(SETTINGS)
    for stat in [DECODE_3_OF_4] * 3 + [PREFILL_20, CUDAGraphStat(2, 2, 0, "FULL")]:
        table.observe(stat)
    for _ in range(100_000):  # a count wider than its header
        table.observe(CUDAGraphStat(1, 1, 0, "FULL"))
    assert table.take() == HEADER + (
        "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count  |\n"
        "|-----------------|---------------|--------------|--------------|--------|\n"
        "| 1               | 1             | 0            | FULL         | 100000 |\n"
        "| 3               | 4             | 1            | FULL         | 3      |\n"
        "| 20              | 20            | 0            | NONE         | 1      |\n"
        "| 2               | 2             | 0            | FULL         | 1      |\n"
    )
    assert table.take() is None, "each table counts the steps since the last one"


def test_no_graphs_show_mode_none_and_no_sizes():
    table = CUDAGraphTable(CUDAGraphSettings())
    table.observe(CUDAGraphStat.eager(7))
    assert table.take() == (
        "**CUDAGraph Config Settings:**\n\n"
        "- Mode: NONE\n"
        "- Capture sizes: []\n\n"
        "**CUDAGraph Stats:**\n\n"
        "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |\n"
        "|-----------------|---------------|--------------|--------------|-------|\n"
        "| 7               | 7             | 0            | NONE         | 1     |\n"
    )


def test_the_stats_line_logs_the_intervals_table_after_its_line(caplog):
    line = StatsLine("GPU", now=0.0, cudagraphs=SETTINGS)
    line.record(step(num_prompt_tokens=20, cudagraph=PREFILL_20))
    line.record(step(num_generation_tokens=3, cudagraph=DECODE_3_OF_4))
    line.record(step())  # an abort between steps: no model step, nothing to count
    with caplog.at_level(logging.INFO, logger="aioserve.stats"):
        line.log(now=1.0)
        line.log(now=2.0)  # no step since: no table
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert messages[0].startswith("Engine 000: Avg prompt throughput: 20.0 tokens/s")
    assert messages[1] == HEADER + (
        "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |\n"
        "|-----------------|---------------|--------------|--------------|-------|\n"
        "| 20              | 20            | 0            | NONE         | 1     |\n"
        "| 3               | 4             | 1            | FULL         | 1     |\n"
    )
    assert caplog.records[1].levelno == logging.INFO
    assert messages[2].startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s")


def test_without_the_flag_the_stats_line_has_no_table(caplog):
    line = StatsLine("GPU", now=0.0)
    line.record(step(num_generation_tokens=3, cudagraph=DECODE_3_OF_4))
    with caplog.at_level(logging.INFO, logger="aioserve.stats"):
        line.log(now=1.0)
    assert [r.getMessage()[:11] for r in caplog.records] == ["Engine 000:"]
