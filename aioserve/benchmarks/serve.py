"""`aioserve bench serve`: an HTTP load generator for any OpenAI-compatible server.

It sends the requests of a workload (aioserve.benchmarks.datasets) to a completions or
chat completions endpoint, streaming, and measures what a client sees: time to first
token, time per output token, inter-token latency and end-to-end latency, plus request and
token throughput. Requests leave at `--request-rate` per second, their gaps drawn from a
gamma distribution of shape `--burstiness` (1: a Poisson process; `inf` rate: all at once),
and at most `--max-concurrency` are in flight. The report and the `--save-result` JSON have
vLLM's layout and keys, so results compare with `vllm bench serve`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from aioserve.benchmarks.datasets import SampleRequest, refuse_hf_dataset
from aioserve.benchmarks.endpoints import (
    BACKENDS,
    CHAT_BACKENDS,
    TIMEOUT,
    Target,
    send_request,
)
from aioserve.benchmarks.statistics import (
    LATENCY_METRICS,
    RequestResult,
    ServingMetrics,
    metric_fields,
    percentile_label,
    serving_metrics,
)
from aioserve.benchmarks.workload import load_tokenizer, serve_requests
from aioserve.config.declaration import ConfigError


def arrival_times(
    count: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """When each request leaves, in seconds after the first one could.

    Gaps follow a gamma distribution of shape `burstiness` and mean 1/`request_rate`
    (exponential, i.e. Poisson arrivals, at burstiness 1; even at infinite burstiness),
    rescaled so the last request leaves at count / request_rate, as in vLLM. An infinite
    rate sends all at time 0.
    """
    if request_rate == float("inf"):
        return [0.0] * count
    if burstiness == float("inf"):  # the gamma distribution's limit: evenly spaced
        gaps = np.full(count, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (count / request_rate) / times[-1]
    return times.tolist()


async def run_requests(
    target: Target,
    requests: Sequence[SampleRequest],
    *,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    rng: np.random.Generator,
    request_id_prefix: str = "",
    num_warmups: int = 0,
    show_progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send `requests` on their schedule; return their results (in order) and the duration."""
    connector = aiohttp.TCPConnector(
        limit=max_concurrency or 0, limit_per_host=max_concurrency or 0, keepalive_timeout=60
    )
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:

        async def limited(
            request: SampleRequest, request_id: str | None, bar: tqdm | None
        ) -> RequestResult:
            async with limit:
                result = await send_request(session, target, request, request_id)
            if bar is not None:
                bar.update(1)
            return result

        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")
            warmups = [limited(requests[0], None, None) for _ in range(num_warmups)]
            await asyncio.gather(*warmups)
            print("Warmup run completed.")
        print("Starting main benchmark run...")
        bar = tqdm(total=len(requests), disable=not show_progress)
        schedule = arrival_times(len(requests), request_rate, burstiness, rng)
        start = time.perf_counter()
        tasks = []
        for index, (request, at) in enumerate(zip(requests, schedule, strict=True)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request_id = f"{request_id_prefix}{index}"
            tasks.append(asyncio.create_task(limited(request, request_id, bar)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def report(
    metrics: ServingMetrics,
    duration: float,
    *,
    request_rate: float,
    max_concurrency: int | None,
    selected_metrics: Sequence[str],
) -> str:
    """The result block vLLM prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, decimals: bool = True) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}")

    row("Successful requests:", metrics.completed, False)
    row("Failed requests:", metrics.failed, False)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency, False)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", duration)
    row("Total input tokens:", metrics.total_input, False)
    row("Total generated tokens:", metrics.total_output, False)
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    headers = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for name in LATENCY_METRICS:
        if name not in selected_metrics:
            continue
        short, title = headers[name]
        stats = metrics.latencies[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        for p, value in stats.percentiles:
            row(f"P{percentile_label(p)} {short} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)


def result_fields(
    metrics: ServingMetrics,
    duration: float,
    results: Sequence[RequestResult],
    output_lens: Sequence[int],
    selected_metrics: Sequence[str],
) -> dict[str, Any]:
    """The benchmark's part of the result JSON, with vLLM's keys."""
    fields: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": list(output_lens),
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    for name in LATENCY_METRICS:
        if name in selected_metrics:
            fields.update(metric_fields(name, metrics.latencies[name]))
    return fields


DETAILED_FIELDS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
)


# --- the command ------------------------------------------------------------------------


def _key_values(items: list[str] | None, option: str) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} takes KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _numbers(text: str, option: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers, got {text!r}") from None
    if any(not 0 < v < 100 for v in values):
        raise ConfigError(f"{option} takes percentiles between 0 and 100, got {text!r}")
    return values


async def _first_model(base_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """(id, root) of the first model the server lists at /v1/models."""
    url = f"{base_url}/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(url, headers=headers) as response:
                response.raise_for_status()
                models = (await response.json())["data"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"cannot list the models at {url}: {error}; give --model") from None
    if not models:
        raise ConfigError(f"the server at {base_url} lists no model; give --model")
    return models[0]["id"], models[0].get("root") or models[0]["id"]


def _sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    )
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `bench serve` with parsed arguments; print the report and return the result JSON."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be positive (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ConfigError(f"--burstiness must be positive, got {args.burstiness}")
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.dataset_name == "hf":
        refuse_hf_dataset()
    percentiles = _numbers(args.metric_percentiles, "--metric-percentiles")
    selected = (args.percentile_metrics or "ttft,tpot,itl").split(",")
    unknown = [name for name in selected if name not in LATENCY_METRICS]
    if unknown:
        raise ConfigError(
            f"--percentile-metrics: unknown metric(s) {', '.join(unknown)}; "
            f"choose from {', '.join(LATENCY_METRICS)}"
        )
    headers = _key_values(args.header, "--header")
    metadata = _key_values(args.metadata, "--metadata")
    if api_key := os.environ.get("OPENAI_API_KEY"):
        headers.setdefault("Authorization", f"Bearer {api_key}")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or BACKENDS[args.backend]

    if args.model is None:
        print("Model not specified, fetching first model from server...")
        model_name, model_id = asyncio.run(_first_model(base_url, headers))
        print(f"First model name: {model_name}, first model id: {model_id}")
    else:
        model_id = args.model
        model_name = args.served_model_name or args.model
    tokenizer_id = args.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id, args.tokenizer_mode)
    requests = serve_requests(args, tokenizer, chat=args.backend in CHAT_BACKENDS)
    # Random prompts are meant to run to their length, as in vLLM.
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    extra_body = {**_sampling_options(args), **(args.extra_body or {})}
    target = Target(
        url=base_url + endpoint,
        model=model_name,
        chat=args.backend in CHAT_BACKENDS,
        headers=headers,
        extra_body=extra_body,
        ignore_eos=ignore_eos,
    )
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    results, duration = asyncio.run(
        run_requests(
            target,
            requests,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            rng=np.random.default_rng(args.seed),
            request_id_prefix=args.request_id_prefix or f"bench-{uuid.uuid4().hex[:8]}-",
            num_warmups=args.num_warmups,
            show_progress=not args.disable_tqdm,
        )
    )
    metrics, output_lens = serving_metrics(
        results,
        duration,
        percentiles,
        lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
    )
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"Failed requests ({len(failures)}), the first ones:")
        for error in failures[:10]:
            print(f"  {error}")
    print(
        report(
            metrics,
            duration,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            selected_metrics=selected,
        )
    )

    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": now,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
        **metadata,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result_fields(metrics, duration, results, output_lens, selected),
    }
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            del result[name]
    if args.save_result:
        path = _result_path(args, model_id, now)
        with open(path, "w", encoding="utf-8") as file:
            json.dump(result, file)
        print(f"Results saved to {path}")
    return result


def _result_path(args: argparse.Namespace, model_id: str, now: str) -> str:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
        f"{model_id.split('/')[-1]}-{now}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name
