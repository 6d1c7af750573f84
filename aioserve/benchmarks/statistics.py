"""Latency and throughput statistics of a serving benchmark, as `vllm bench serve` computes them.

Per request the client records when it sent the request, when each streamed chunk arrived
and how many tokens came back. From those:

- TTFT, time to first token: first chunk - request sent;
- ITL, inter-token latency: the gap between two consecutive chunks (all requests' gaps
  pooled);
- TPOT, time per output token: (E2EL - TTFT) / (output tokens - 1), for requests with more
  than one output token;
- E2EL, end-to-end latency: last chunk - request sent.

A request is good, for `--goodput`, when each of its TTFT, TPOT (0 for a request of one
token) and E2EL named in the objectives is at most the objective's milliseconds.

Each is summarized by its mean, median, standard deviation and the requested percentiles,
in milliseconds. Percentiles interpolate linearly between the two nearest ranks (numpy's
default, as in vLLM): the p-th percentile of sorted x[0..n-1] is x at rank p/100 * (n-1).
The report's rows and metric blocks are laid out here as vLLM prints them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# Reported only with --max-concurrency (the second also needs a finite request rate).
QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, from time.perf_counter)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None  # the server's usage.completion_tokens, when it sent one
    generated_text: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    # Time between the request's turn in the schedule and its sending (--max-concurrency).
    client_queue_time: float = 0.0
    # Texts in the request: more than 1 for a batch of prompts to a pooling backend.
    num_input_sequences: int = 1


@dataclass(frozen=True)
class LatencyStats:
    """One metric's summary, in milliseconds; zeros when nothing was measured."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)


@dataclass(frozen=True)
class ServingMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float  # good requests per second; 0 without objectives
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latencies: dict[str, LatencyStats]  # by metric name: "ttft", "tpot", "itl", "e2el"
    rtfx: float = 0.0  # vLLM's inverse real-time factor of audio inputs: 0 for text


# Each metric's short name and the title of its block in the report, as vLLM prints them.
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": (
        "E2EL incl. Client Queue",
        "Queue-inclusive End-to-end Latency",
    ),
}


def report_row(label: str, value: Any, decimals: bool = True) -> str:
    """One line of vLLM's report: the label in 40 columns, the value in 10 (2 decimals)."""
    return f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}"


def latency_blocks(latencies: dict[str, LatencyStats], selected: Sequence[str]) -> list[str]:
    """The report's block of each selected metric that was measured, in vLLM's order:
    a titled rule, the mean, the median and the percentiles."""
    lines = []
    for name in (*LATENCY_METRICS, *QUEUE_METRICS):
        if name not in selected or name not in latencies:
            continue
        short, title = METRIC_TITLES[name]
        stats = latencies[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(report_row(f"Mean {short} (ms):", stats.mean))
        lines.append(report_row(f"Median {short} (ms):", stats.median))
        for p, value in stats.percentiles:
            lines.append(report_row(f"P{percentile_label(p)} {short} (ms):", value))
    return lines


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Mean, median, standard deviation and percentiles of `values_s`, converted to ms."""
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(
        mean=float(np.mean(values)),
        median=float(np.median(values)),
        std=float(np.std(values)),
        percentiles=[(float(p), float(np.percentile(values, p))) for p in percentiles],
    )


def percentile_label(p: float) -> str:
    """How a percentile is written in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def metric_fields(name: str, stats: LatencyStats) -> dict[str, float]:
    """vLLM's result keys of one metric: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
    fields = {
        f"mean_{name}_ms": stats.mean,
        f"median_{name}_ms": stats.median,
        f"std_{name}_ms": stats.std,
    }
    for p, value in stats.percentiles:
        fields[f"p{percentile_label(p)}_{name}_ms"] = value
    return fields


def _peaks(results: Sequence[RequestResult]) -> tuple[float, int]:
    """The most chunks that arrived within one second, and the most requests active within
    one second, as vLLM counts them.

    Time is cut into one-second slots from the first request's start; a request counts in
    every slot from the one it started in to the one it ended in, so requests that ran one
    after another within a second all count in it.
    """
    if not results:
        return 0.0, 0
    origin = min(r.start_time for r in results)
    end = max(r.start_time + r.latency for r in results)
    slots = int(math.ceil(end - origin)) + 1
    per_second = np.zeros(slots)
    active = np.zeros(slots)
    for result in results:
        arrival = result.start_time + result.ttft
        for gap in [0.0, *result.itl]:
            arrival += gap
            slot = int(arrival - origin)
            if 0 <= slot < slots:
                per_second[slot] += 1
        first = int(result.start_time - origin)
        last = int(result.start_time + result.latency - origin)
        active[first : last + 1] += 1
    return float(per_second.max()), int(active.max())


def is_good(ttft: float, tpot: float, e2el: float, objectives_ms: dict[str, float]) -> bool:
    """Whether a request meets every objective (milliseconds) of --goodput."""
    measured = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    # Objective converted to seconds, not the time to ms: vLLM's rounding at the boundary.
    return all(limit / 1000 >= measured[name] for name, limit in objectives_ms.items())


def serving_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    count_tokens: Callable[[str], int],
    goodput_ms: dict[str, float] | None = None,
) -> tuple[ServingMetrics, list[int]]:
    """The benchmark's metrics, and each request's output length (0 for a failed one).

    `goodput_ms`: the --goodput objectives in milliseconds, by metric (ttft, tpot, e2el).

    A request's output length is the server's usage.completion_tokens, or else the number
    of tokens `count_tokens` finds in its generated text.
    """
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = 0
    good = 0
    succeeded = [r for r in results if r.success]
    for result in results:
        if not result.success:
            output_lens.append(0)
            continue
        output_len = result.output_tokens
        if output_len is None:
            output_len = count_tokens(result.generated_text)
        output_lens.append(output_len)
        total_input += result.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (result.latency - result.ttft) / (output_len - 1)
            tpots.append(tpot)
        if goodput_ms and is_good(result.ttft, tpot, result.latency, goodput_ms):
            good += 1
        ttfts.append(result.ttft)
        itls.extend(result.itl)
        e2els.append(result.latency)
    total_output = sum(output_lens)
    peak_tokens, peak_requests = _peaks(succeeded)
    metrics = ServingMetrics(
        completed=len(succeeded),
        failed=len(results) - len(succeeded),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(succeeded) / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
        latencies={
            "ttft": latency_stats(ttfts, percentiles),
            "tpot": latency_stats(tpots, percentiles),
            "itl": latency_stats(itls, percentiles),
            "e2el": latency_stats(e2els, percentiles),
        },
    )
    return metrics, output_lens
