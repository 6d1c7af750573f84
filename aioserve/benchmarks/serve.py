"""`aioserve bench serve`: an HTTP load generator for any OpenAI-compatible server.

It sends the requests of a workload (aioserve.benchmarks.datasets) to a completions or
chat completions endpoint, streaming, and measures what a client sees: time to first
token, time per output token, inter-token latency and end-to-end latency, plus request and
token throughput. Requests leave at `--request-rate` per second, their gaps drawn from a
gamma distribution of shape `--burstiness` (1: a Poisson process; `inf` rate: all at once),
or at a rate ramped from `--ramp-up-start-rps` to `--ramp-up-end-rps`, and at most
`--max-concurrency` are in flight. The report and the `--save-result` JSON have
vLLM's layout and keys, so results compare with `vllm bench serve`'s. With `--backend
openai-embeddings` the requests go to /v1/embeddings of a pooling model instead, and the
run is measured and reported as vLLM does it for pooling (pooling.py).
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

from aioserve.benchmarks import pooling, serve_options
from aioserve.benchmarks.datasets import SampleRequest, refuse_hf_dataset
from aioserve.benchmarks.endpoints import (
    BACKENDS,
    CHAT_BACKENDS,
    TIMEOUT,
    Target,
    call_profiler,
    send_request,
)
from aioserve.benchmarks.statistics import (
    LATENCY_METRICS,
    QUEUE_METRICS,
    LatencyStats,
    RequestResult,
    ServingMetrics,
    latency_blocks,
    latency_stats,
    metric_fields,
    report_row,
    serving_metrics,
)
from aioserve.benchmarks.workload import load_tokenizer, serve_requests, with_lora_modules
from aioserve.config.declaration import ConfigError

READY_RETRY_S = 5


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    request: SampleRequest,
    request_id: str | None = None,
) -> RequestResult:
    """One request of the run: an embeddings request for a pooling backend, else a
    streamed generation."""
    if target.pooling:
        return await pooling.send_pooling_request(session, target, request, request_id)
    return await send_request(session, target, request, request_id)


def ramp_rates(count: int, strategy: str, start_rps: float, end_rps: float) -> list[float]:
    """Each request's rate under a ramp-up: from `start_rps` at the first request to
    `end_rps` at the last, linearly or exponentially in the request's index."""
    rates = []
    for index in range(count):
        progress = index / max(count - 1, 1)
        if strategy == "linear":
            rates.append(start_rps + (end_rps - start_rps) * progress)
        else:
            rates.append(start_rps * (end_rps / start_rps) ** progress)
    return rates


def arrival_times(
    count: int,
    request_rate: float,
    burstiness: float,
    rng: np.random.Generator,
    rates: Sequence[float] | None = None,
) -> list[float]:
    """When each request leaves, in seconds after the first one could.

    Gaps follow a gamma distribution of shape `burstiness` and mean 1/rate (exponential,
    i.e. Poisson arrivals, at burstiness 1; even at infinite burstiness); an infinite rate
    sends at once. At a fixed `request_rate` the times are rescaled so the last request
    leaves at count / request_rate, as in vLLM; with per-request `rates` (a ramp-up) each
    gap follows its request's rate and nothing is rescaled.
    """
    per_request = list(rates) if rates is not None else [request_rate] * count
    gaps = []
    for rate in per_request:
        if rate == float("inf"):
            gaps.append(0.0)
        elif burstiness == float("inf"):  # the gamma distribution's limit: evenly spaced
            gaps.append(1.0 / rate)
        else:
            gaps.append(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))
    times = np.cumsum(gaps)
    if rates is None and count and times[-1] > 0:
        times *= (count / request_rate) / times[-1]
    return times.tolist()


def rps_change_events(
    send_times: Sequence[datetime], rates: Sequence[float], start_rps: int
) -> list[dict[str, Any]]:
    """vLLM's record of a ramp-up: when the rate first reached each whole number of
    requests per second, from `start_rps` on."""
    events = [{"rps": start_rps, "timestamp": send_times[0].isoformat()}] if send_times else []
    last = start_rps
    for sent, rate in zip(send_times, rates, strict=True):
        if int(rate) > last:
            events += [
                {"rps": r, "timestamp": sent.isoformat()} for r in range(last + 1, int(rate) + 1)
            ]
            last = int(rate)
    return events


async def wait_until_ready(
    session: aiohttp.ClientSession, target: Target, request: SampleRequest, timeout_s: int
) -> None:
    """Send `request` until it succeeds, every 5 s, for at most `timeout_s` seconds."""
    print(f"Waiting for endpoint to become up in {timeout_s} seconds")
    deadline = time.perf_counter() + timeout_s
    error = "no attempt"
    while (remaining := deadline - time.perf_counter()) > 0:
        result = await send(session, target, request)
        if result.success:
            print("Initial test run completed.")
            return
        error = result.error
        print(f"Endpoint is not ready: {error.rstrip().rsplit(chr(10), 1)[-1]}")
        await asyncio.sleep(min(READY_RETRY_S, max(remaining, 0)))
    raise ConfigError(
        "Initial test run failed - Please make sure benchmark arguments are correctly "
        f"specified. Error: {error}"
    )


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
    rates: Sequence[float] | None = None,
    ready_check_timeout_s: int = 0,
    sent_at: list[datetime] | None = None,
    profile_base_url: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `requests` on their schedule; return their results (in order) and the duration.

    `profile_base_url`, when given, is the server whose profiler runs over the timed
    requests (--profile).

    `rates`: per-request rates of a ramp-up, instead of `request_rate`. Each result's
    client_queue_time is how long it waited for a --max-concurrency slot after its time
    came. `sent_at`, when given, receives the wall-clock time each request's turn came.
    """
    connector = aiohttp.TCPConnector(
        limit=max_concurrency or 0, limit_per_host=max_concurrency or 0, keepalive_timeout=60
    )
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:

        async def limited(
            request: SampleRequest, request_id: str | None, bar: tqdm | None, due: float
        ) -> RequestResult:
            async with limit:
                result = await send(session, target, request, request_id)
            result.client_queue_time = result.start_time - due
            if bar is not None:
                bar.update(1)
            return result

        print("Starting initial single prompt test run...")
        if ready_check_timeout_s > 0:
            await wait_until_ready(session, target, requests[0], ready_check_timeout_s)
        else:
            print("Skipping endpoint ready check.")
        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")
            warmups = [
                limited(requests[0], None, None, time.perf_counter()) for _ in range(num_warmups)
            ]
            await asyncio.gather(*warmups)
            print("Warmup run completed.")
        if profile_base_url is not None:
            print("Starting profiler...")
            await call_profiler(session, profile_base_url, "start", target.headers)
            print("Profiler started")
        print("Starting main benchmark run...")
        bar = tqdm(total=len(requests), disable=not show_progress)
        schedule = arrival_times(len(requests), request_rate, burstiness, rng, rates)
        start = time.perf_counter()
        tasks = []
        for index, (request, at) in enumerate(zip(requests, schedule, strict=True)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sent_at is not None:
                sent_at.append(datetime.now())
            request_id = f"{request_id_prefix}{index}"
            due = time.perf_counter()
            tasks.append(asyncio.create_task(limited(request, request_id, bar, due)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        if profile_base_url is not None:
            print("Stopping profiler...")
            await call_profiler(session, profile_base_url, "stop", target.headers)
            print("Profiler stopped")
    return list(results), duration


def report(
    metrics: ServingMetrics,
    duration: float,
    *,
    request_rate: float,
    max_concurrency: int | None,
    selected_metrics: Sequence[str],
    goodput: bool = False,
    extra_latencies: dict[str, LatencyStats] | None = None,
) -> str:
    """The result block vLLM prints. `extra_latencies`: the queue metrics, when measured."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, decimals: bool = True) -> None:
        lines.append(report_row(label, value, decimals))

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
    if goodput:
        row("Request goodput (req/s):", metrics.request_goodput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    lines += latency_blocks({**metrics.latencies, **(extra_latencies or {})}, selected_metrics)
    lines.append("=" * 50)
    return "\n".join(lines)


def queue_latencies(
    results: Sequence[RequestResult],
    percentiles: Sequence[float],
    request_rate: float,
    max_concurrency: int | None,
) -> dict[str, LatencyStats]:
    """The queue metrics vLLM measures: client_queue_time with --max-concurrency, and
    e2el_including_client_queue with it at a finite request rate (successful requests)."""
    if max_concurrency is None:
        return {}
    succeeded = [r for r in results if r.success]
    stats = {
        "client_queue_time": latency_stats([r.client_queue_time for r in succeeded], percentiles)
    }
    if request_rate != float("inf"):
        stats["e2el_including_client_queue"] = latency_stats(
            [r.latency + r.client_queue_time for r in succeeded], percentiles
        )
    return stats


def result_fields(
    metrics: ServingMetrics,
    duration: float,
    results: Sequence[RequestResult],
    output_lens: Sequence[int],
    selected_metrics: Sequence[str],
    goodput: bool = False,
    extra_latencies: dict[str, LatencyStats] | None = None,
    rps_events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The benchmark's part of the result JSON, with vLLM's keys in vLLM's order
    (`rps_events`: a ramp-up's rps_change_events, before the metrics as in vLLM)."""
    fields: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": list(output_lens),
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": metrics.rtfx,
    }
    if rps_events is not None:
        fields["rps_change_events"] = rps_events
    latencies = {**metrics.latencies, **(extra_latencies or {})}
    for name in (*LATENCY_METRICS, *QUEUE_METRICS):
        if name in selected_metrics and name in latencies:
            fields.update(metric_fields(name, latencies[name]))
    return fields


# Dropped without --save-detailed, as vLLM does (it keeps latencies and queue_times).
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


def _check_options(args: argparse.Namespace) -> None:
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
    if args.logprobs is not None and args.backend not in ("openai", "vllm"):
        raise ConfigError(
            "--logprobs is sent with completions requests only (as vLLM does); "
            "drop it or use --backend openai"
        )
    serve_options.check_ramp_up(args)
    pooling.check_options(args)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `bench serve` with parsed arguments; print the report and return the result JSON."""
    _check_options(args)
    pooled = args.backend in pooling.POOLING_BACKENDS
    percentiles = serve_options.percentiles(args.metric_percentiles)
    selected = serve_options.percentile_metrics(
        args.percentile_metrics, default=",".join(pooling.POOLING_METRICS) if pooled else None
    )
    goodput_ms = serve_options.goodput(args.goodput)
    headers = serve_options.key_values(args.header, "--header")
    metadata = serve_options.key_values(args.metadata, "--metadata")
    if api_key := os.environ.get("OPENAI_API_KEY"):
        headers.setdefault("Authorization", f"Bearer {api_key}")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or {**BACKENDS, **pooling.POOLING_BACKENDS}[args.backend]
    if pooled:
        pooling.check_url(args.backend, base_url + endpoint)
        for note in pooling.notes(args, selected):
            print(note)

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
    if pooled:
        requests = pooling.batch_requests(requests, args.random_batch_size)
    if args.lora_modules:
        requests = with_lora_modules(requests, args.lora_modules, args.lora_assignment, args.seed)
    # Random prompts are meant to run to their length, as in vLLM (generation only).
    ignore_eos = args.ignore_eos or (args.dataset_name == "random" and not pooled)
    extra_body = {**({} if pooled else _sampling_options(args)), **(args.extra_body or {})}
    target = Target(
        url=base_url + endpoint,
        model=model_name,
        chat=args.backend in CHAT_BACKENDS,
        headers=headers,
        extra_body=extra_body,
        ignore_eos=ignore_eos,
        logprobs=args.logprobs,
        pooling=pooled,
    )
    rates = None
    if args.ramp_up_strategy is not None:
        rates = ramp_rates(
            len(requests), args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps
        )
        print(f"Traffic ramp-up strategy: {args.ramp_up_strategy}.")
        print(
            f"Will increase RPS from {args.ramp_up_start_rps} to {args.ramp_up_end_rps} RPS "
            "over the duration of the benchmark."
        )
    else:
        print(f"Traffic request rate: {args.request_rate}")
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    sent_at: list[datetime] = []
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
            rates=rates,
            ready_check_timeout_s=args.ready_check_timeout_sec,
            sent_at=sent_at,
            profile_base_url=base_url if args.profile else None,
        )
    )
    queue_stats = queue_latencies(results, percentiles, args.request_rate, args.max_concurrency)
    for name in QUEUE_METRICS:
        if name in selected and name not in queue_stats:
            print(f"{name} is not measured in this run (vLLM's rule): see --percentile-metrics")
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"Failed requests ({len(failures)}), the first ones:")
        for error in failures[:10]:
            print(f"  {error}")
    events = None
    if rates is not None:
        events = rps_change_events(sent_at, rates, args.ramp_up_start_rps)
    if pooled:
        embed_metrics = pooling.pooling_metrics(results, duration, percentiles)
        text = pooling.report(
            embed_metrics,
            duration,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            selected_metrics=selected,
            extra_latencies=queue_stats,
        )
        fields = pooling.result_fields(
            embed_metrics, duration, results, selected, queue_stats, events
        )
    else:
        metrics, output_lens = serving_metrics(
            results,
            duration,
            percentiles,
            lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
            goodput_ms,
        )
        text = report(
            metrics,
            duration,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            selected_metrics=selected,
            goodput=bool(goodput_ms),
            extra_latencies=queue_stats,
        )
        fields = result_fields(
            metrics,
            duration,
            results,
            output_lens,
            selected,
            bool(goodput_ms),
            queue_stats,
            events,
        )
    print(text)

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
    }
    if rates is not None:
        result["ramp_up_strategy"] = args.ramp_up_strategy
        result["ramp_up_start_rps"] = args.ramp_up_start_rps
        result["ramp_up_end_rps"] = args.ramp_up_end_rps
    result.update(fields)
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            result.pop(name, None)
    if args.save_result or args.append_result:
        path = _result_path(args, model_id, now)
        with open(path, "a+" if args.append_result else "w", encoding="utf-8") as file:
            if args.append_result and file.tell() != 0:
                file.write("\n")
            json.dump(result, file)
        print(f"Results saved to {path}")
    return result


def _result_path(args: argparse.Namespace, model_id: str, now: str) -> str:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    if args.ramp_up_strategy is not None:
        rate = (
            f"ramp-up-{args.ramp_up_strategy}-{args.ramp_up_start_rps}qps-{args.ramp_up_end_rps}qps"
        )
    else:
        rate = f"{args.request_rate}qps"
    name = args.result_filename or (
        f"{args.label or args.backend}-{rate}{concurrency}-{model_id.split('/')[-1]}-{now}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name
