"""Serving statistics on synthetic timings, against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aioserve.benchmarks.endpoints import SSEDecoder
from aioserve.benchmarks.serve import arrival_times
from aioserve.benchmarks.statistics import (
    RequestResult,
    latency_stats,
    metric_fields,
    serving_metrics,
)


def words(text: str) -> int:
    return len(text.split())


RESULTS = [
    # sent at 0.00; chunks at 0.10, 0.12, 0.16; 3 tokens
    RequestResult(True, 10, 3, "", 0.00, 0.10, [0.02, 0.04], 0.16),
    # sent at 0.05; chunks at 0.35, 0.36; 2 tokens
    RequestResult(True, 20, 2, "", 0.05, 0.30, [0.01], 0.31),
    RequestResult(False, 99, None, "", 0.07, error="HTTP 500"),
    # sent at 0.10; one chunk at 0.30; no usage: the text has 1 word
    RequestResult(True, 5, None, "hello", 0.10, 0.20, [], 0.20),
]


def test_serving_metrics_by_hand():
    metrics, output_lens = serving_metrics(RESULTS, 2.0, [50, 99], words)
    assert output_lens == [3, 2, 0, 1]
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input, metrics.total_output) == (35, 6)
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(3.0)
    assert metrics.total_token_throughput == pytest.approx(20.5)

    ttft = metrics.latencies["ttft"]  # 100, 300, 200 ms
    assert ttft.mean == pytest.approx(200)
    assert ttft.median == pytest.approx(200)
    assert ttft.std == pytest.approx(math.sqrt(20000 / 3))
    # sorted 100, 200, 300: p50 at rank 1, p99 at rank 1.98 = 200 + 0.98 * 100
    assert ttft.percentiles == [(50, pytest.approx(200)), (99, pytest.approx(298))]

    tpot = metrics.latencies["tpot"]  # (160-100)/2 = 30, (310-300)/1 = 10; 1-token request left out
    assert (tpot.mean, tpot.median) == (pytest.approx(20), pytest.approx(20))
    assert tpot.percentiles[1] == (99, pytest.approx(10 + 0.99 * 20))

    itl = metrics.latencies["itl"]  # 20, 40, 10 pooled
    assert itl.mean == pytest.approx(70 / 3)
    assert itl.median == pytest.approx(20)
    assert itl.percentiles[1] == (99, pytest.approx(20 + 0.98 * 20))

    e2el = metrics.latencies["e2el"]  # 160, 310, 200
    assert e2el.mean == pytest.approx(670 / 3)
    assert e2el.percentiles[1] == (99, pytest.approx(200 + 0.98 * 110))

    # [0, .16), [.05, .36), [.10, .30) all overlap at 0.1; all 6 chunks land in second 0
    assert metrics.max_concurrent_requests == 3
    assert metrics.max_output_tokens_per_s == 6


def test_percentiles_of_four_values():
    stats = latency_stats([0.001, 0.002, 0.003, 0.010], [25, 50, 90])
    # ranks 0.75, 1.5, 2.7 between 1, 2, 3, 10 ms
    assert [v for _, v in stats.percentiles] == pytest.approx([1.75, 2.5, 3 + 0.7 * 7])
    assert stats.median == pytest.approx(2.5)
    assert stats.mean == pytest.approx(4.0)


def test_nothing_measured_gives_zeros():
    metrics, output_lens = serving_metrics([RequestResult(error="refused")], 1.0, [99], words)
    assert output_lens == [0]
    assert (metrics.completed, metrics.failed, metrics.total_output) == (0, 1, 0)
    assert metrics.latencies["ttft"].mean == 0.0
    assert metrics.max_concurrent_requests == 0


def test_result_keys_follow_vllm():
    stats = latency_stats([0.1], [99, 99.9])
    assert sorted(metric_fields("ttft", stats)) == sorted(
        ["mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"]
    )


def test_arrival_times():
    rng = np.random.default_rng(0)
    assert arrival_times(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, float("inf"), rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_times(50, 10.0, 1.0, rng)
    assert poisson == sorted(poisson)
    assert poisson[-1] == pytest.approx(5.0)  # rescaled so the last leaves at count / rate
    gaps = np.diff([0.0, *poisson])
    bursty = np.diff([0.0, *arrival_times(50, 10.0, 0.2, np.random.default_rng(0))])
    assert np.std(bursty) > np.std(gaps)  # burstiness below 1 spreads the gaps


def test_sse_decoder_reassembles_split_events():
    decoder = SSEDecoder()
    stream = (
        b': ping\n\ndata: {"a": 1}\n\n'
        b'data: {"b":\r\ndata: 2}\r\n\r\n'
        b'event: message\ndata: {"c": "\xc3\xa9"}\n\n'
        b"data: [DONE]\n\n"
    )
    received = []
    for start in range(0, len(stream), 7):  # cut anywhere, even inside a UTF-8 character
        received += decoder.feed(stream[start : start + 7])
    assert received == ['{"a": 1}', '{"b":\n2}', '{"c": "é"}', "[DONE]"]
    assert decoder.feed(b'data: {"tail": true}') == []
    assert decoder.finish() == ['{"tail": true}']
