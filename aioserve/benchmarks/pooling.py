"""`bench serve` against a pooling model: vLLM 0.32's `--backend openai-embeddings`.

As vLLM's benchmark does it (benchmarks/lib/endpoint_request_func.py:
async_request_openai_embeddings and _run_pooling_request; serve.py:
calculate_metrics_for_embeddings and the pooling branch of `benchmark`):

- Each request is one POST to /v1/embeddings, not streamed: {"model", "input": the
  prompt (or, with `--random-batch-size N`, a list of N prompts), "truncate_prompt_tokens":
  -1}, then `ignore_eos` when --ignore-eos is given and --extra-body. No sampling option is
  sent, and the random dataset does not turn on `ignore_eos` as it does for generation.
- Its latency is the time until the whole answer is read; its input tokens are the answer's
  `usage.prompt_tokens` (with `encoding_format` "bytes": the `metadata` header's usage;
  "bytes_only": the request's own count). A request that fails (an HTTP error, a dropped
  connection, an unreadable answer) is counted as failed; it never stops the benchmark.
- The report has no TTFT, TPOT or ITL, no generated tokens and no goodput: input tokens,
  requests/s, "Input throughput (inputs/s)" (the texts embedded per second), tokens/s, the
  "End-to-end Latency" block (the default --percentile-metrics) and the queue metrics. The
  result JSON has vLLM's pooling keys: no `failed`, `total_input_sequences` and
  `input_sequence_throughput` instead of the output keys.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from aioserve.benchmarks.datasets import SampleRequest
from aioserve.benchmarks.endpoints import Target
from aioserve.benchmarks.statistics import (
    LATENCY_METRICS,
    QUEUE_METRICS,
    LatencyStats,
    RequestResult,
    latency_blocks,
    latency_stats,
    metric_fields,
    report_row,
)
from aioserve.config.declaration import ConfigError

# Pooling backend -> the endpoint it talks to when --endpoint is not given (vLLM's default
# is /v1/completions for every backend, which its embeddings client then refuses).
POOLING_BACKENDS = {"openai-embeddings": "/v1/embeddings"}
# vLLM's _validate_api_url: what the URL of each pooling backend must end with.
_URL_SUFFIXES = {"openai-embeddings": ("OpenAI Embeddings API", "embeddings")}
# The metrics a pooling run measures, beside the queue metrics (vLLM's default for them).
POOLING_METRICS = ("e2el",)


def check_url(backend: str, url: str) -> None:
    """vLLM's check of the API URL, with its words, before anything is sent."""
    api_name, suffix = _URL_SUFFIXES[backend]
    if not url.endswith(suffix):
        raise ConfigError(f"{api_name} URL must end with one of: {{'{suffix}'}}.")


def check_options(args: argparse.Namespace) -> None:
    """--random-batch-size: at least 1; above 1 only for a pooling backend on the random
    dataset (vLLM: "Only used for embeddings benchmark"; it batches nothing else)."""
    size = args.random_batch_size
    if size < 1:
        raise ConfigError(f"--random-batch-size must be at least 1, got {size}")
    if size == 1:
        return
    if args.backend not in POOLING_BACKENDS:
        raise ConfigError(
            "--random-batch-size sends lists of prompts, which only the embeddings backend "
            f"does (--backend {', '.join(POOLING_BACKENDS)}), as in vLLM"
        )
    if args.dataset_name != "random":
        raise ConfigError(
            f"--random-batch-size batches the random dataset's prompts only; vLLM ignores it "
            f"for --dataset-name {args.dataset_name}: drop it"
        )


def notes(args: argparse.Namespace, selected_metrics: Sequence[str]) -> list[str]:
    """What vLLM accepts with a pooling backend and then leaves out, said once each."""
    said = []
    sampling = [
        name
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        )
        if getattr(args, name) is not None
    ]
    if sampling:
        options = ", ".join("--" + name.replace("_", "-") for name in sampling)
        said.append(f"{options}: not sent to a pooling backend (as in vLLM)")
    if args.goodput:
        said.append("--goodput: not measured for a pooling backend (as in vLLM)")
    unmeasured = [name for name in LATENCY_METRICS if name in selected_metrics]
    unmeasured = [name for name in unmeasured if name not in POOLING_METRICS]
    if unmeasured:
        said.append(
            f"{', '.join(unmeasured)}: not measured for a pooling backend (vLLM reports e2el "
            "and the queue metrics)"
        )
    return said


def batch_requests(requests: Sequence[SampleRequest], batch_size: int) -> list[SampleRequest]:
    """vLLM's --random-batch-size: consecutive requests grouped `batch_size` at a time into
    one request whose input is their prompts' list (the last group may be smaller)."""
    if batch_size <= 1:
        return list(requests)
    return [
        SampleRequest(
            prompt=[r.prompt for r in requests[i : i + batch_size]],
            prompt_len=sum(r.prompt_len for r in requests[i : i + batch_size]),
            expected_output_len=0,
        )
        for i in range(0, len(requests), batch_size)
    ]


def embeddings_payload(target: Target, request: SampleRequest) -> dict[str, Any]:
    """The JSON body of one /v1/embeddings request, as vLLM's benchmark builds it."""
    payload: dict[str, Any] = {
        "model": target.model,
        "input": request.prompt,
        # vLLM: many embedding models have a short context; this keeps long prompts in.
        "truncate_prompt_tokens": -1,
    }
    if target.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(target.extra_body)
    return payload


def _input_sequences(prompt: Any) -> int:
    """vLLM's _get_num_input_sequences: the length of a list of prompts, else 1."""
    if prompt and isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


async def send_pooling_request(
    session: aiohttp.ClientSession,
    target: Target,
    request: SampleRequest,
    request_id: str | None = None,
) -> RequestResult:
    """Send one embeddings request and time it; failures are recorded, not raised.

    A failed request's prompt_len is 0, as vLLM's is.
    """
    payload = embeddings_payload(target, request)
    result = RequestResult(num_input_sequences=_input_sequences(request.prompt))
    headers = dict(target.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id
    start = time.perf_counter()
    result.start_time = start
    try:
        async with session.post(target.url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                result.error = f"HTTP {response.status} {response.reason}: {body}"
                return result
            encoding = payload.get("encoding_format", "float")
            raw = b""
            if encoding in ("bytes", "bytes_only"):
                async for _ in response.content.iter_any():
                    pass
            else:
                raw = await response.read()
            result.ttft = result.latency = time.perf_counter() - start
            if encoding == "bytes":
                usage = json.loads(response.headers["metadata"]).get("usage") or {}
            elif encoding == "bytes_only":
                usage = {"prompt_tokens": request.prompt_len}
            else:
                usage = json.loads(raw).get("usage") or {}
            tokens = usage.get("prompt_tokens", 0)
            result.prompt_len = tokens if isinstance(tokens, int) else 0
            result.success = True
    except Exception as error:  # a misbehaving server fails its request, not the benchmark
        result.success = False
        result.error = f"{type(error).__name__}: {error}"
    return result


@dataclass(frozen=True)
class PoolingMetrics:
    """vLLM's EmbedBenchmarkMetrics: counts and rates of the successful requests."""

    completed: int
    failed: int
    total_input: int
    total_input_sequences: int
    request_throughput: float
    input_sequence_throughput: float
    total_token_throughput: float
    e2el: LatencyStats


def pooling_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float]
) -> PoolingMetrics:
    """vLLM's calculate_metrics_for_embeddings: tokens, texts and latencies of the
    successful requests, per second of the run."""
    succeeded = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in succeeded)
    sequences = sum(r.num_input_sequences for r in succeeded)
    return PoolingMetrics(
        completed=len(succeeded),
        failed=len(results) - len(succeeded),
        total_input=total_input,
        total_input_sequences=sequences,
        request_throughput=len(succeeded) / duration_s,
        input_sequence_throughput=sequences / duration_s,
        total_token_throughput=total_input / duration_s,
        e2el=latency_stats([r.latency for r in succeeded], percentiles),
    )


def report(
    metrics: PoolingMetrics,
    duration: float,
    *,
    request_rate: float,
    max_concurrency: int | None,
    selected_metrics: Sequence[str],
    extra_latencies: dict[str, LatencyStats] | None = None,
) -> str:
    """The result block vLLM prints for a pooling backend."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(report_row("Successful requests:", metrics.completed, False))
    lines.append(report_row("Failed requests:", metrics.failed, False))
    if max_concurrency is not None:
        lines.append(report_row("Maximum request concurrency:", max_concurrency, False))
    if request_rate != float("inf"):
        lines.append(report_row("Request rate configured (RPS):", request_rate))
    lines.append(report_row("Benchmark duration (s):", duration))
    lines.append(report_row("Total input tokens:", metrics.total_input, False))
    lines.append(report_row("Request throughput (req/s):", metrics.request_throughput))
    lines.append(report_row("Input throughput (inputs/s):", metrics.input_sequence_throughput))
    lines.append(report_row("Total token throughput (tok/s):", metrics.total_token_throughput))
    latencies = {"e2el": metrics.e2el, **(extra_latencies or {})}
    lines += latency_blocks(latencies, selected_metrics)
    lines.append("=" * 50)
    return "\n".join(lines)


def result_fields(
    metrics: PoolingMetrics,
    duration: float,
    results: Sequence[RequestResult],
    selected_metrics: Sequence[str],
    extra_latencies: dict[str, LatencyStats] | None = None,
    rps_events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The benchmark's part of the result JSON for a pooling backend: vLLM's keys in
    vLLM's order (input_lens and errors are dropped without --save-detailed; `rps_events`:
    a ramp-up's rps_change_events, before the metrics)."""
    fields: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_input_sequences": metrics.total_input_sequences,
        "request_throughput": metrics.request_throughput,
        "input_sequence_throughput": metrics.input_sequence_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in results],
        "latencies": [r.latency for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "errors": [r.error for r in results],
    }
    if rps_events is not None:
        fields["rps_change_events"] = rps_events
    latencies = {"e2el": metrics.e2el, **(extra_latencies or {})}
    for name in (*POOLING_METRICS, *QUEUE_METRICS):
        if name in selected_metrics and name in latencies:
            fields.update(metric_fields(name, latencies[name]))
    return fields
