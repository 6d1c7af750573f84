"""Prometheus metrics at `GET /metrics`, under vLLM's names so its dashboards work unchanged.

`PrometheusStatLogger` is a `StatLogger`: the engine hands it a `StepStats` after every
step and abort, and it turns them into vLLM's metrics on its own `CollectorRegistry` (never
prometheus-client's global one, so several apps can live in one process). `add_metrics`
wires it into an aiohttp app: the route, the engine's `stat_loggers`, the event-loop lag
monitor and, unless `--disable-log-stats`, the periodic stats line (stats_log.py).

Names, types, help texts, labels and bucket boundaries are those of vLLM 0.32's own
/metrics page (shared/reference/vllm_samples/24_metrics.txt). Every series carries
`model_name` (the first served model name) and `engine="0"`, as vLLM's do;
`vllm:cache_config_info`, like vLLM's, carries only `engine` and the cache settings.
The process, platform and GC collectors vLLM exposes (`process_*`, `python_*`) are there too.
The page is in the Prometheus text format, as vLLM's is, whatever the scraper's Accept (see
`serve_metrics`).

Exposed, measured by the engine:
    gauges      vllm:num_requests_running, vllm:num_requests_waiting,
                vllm:kv_cache_usage_perc, vllm:cache_config_info
    counters    vllm:prompt_tokens_total, vllm:generation_tokens_total,
                vllm:num_preemptions_total, vllm:prefix_cache_queries_total,
                vllm:prefix_cache_hits_total, vllm:request_success_total{finished_reason}
    per step    vllm:iteration_tokens_total, vllm:time_to_first_token_seconds,
                vllm:inter_token_latency_seconds
    per request vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
                vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
                vllm:request_inference_time_seconds,
                vllm:request_time_per_output_token_seconds, vllm:request_prompt_tokens,
                vllm:request_generation_tokens, vllm:request_max_num_generation_tokens,
                vllm:request_params_n, vllm:request_params_max_tokens,
                vllm:request_num_preemptions, vllm:request_prefill_kv_computed_tokens
    shed        vllm:admission_rejections_total{reason}: requests refused by
                --max-num-queued-reqs or --max-num-queued-tokens (engine/load_shedding.py),
                labelled, as vLLM's, by model_name and reason only
    sleep       vllm:engine_sleep_state{sleep_state}: awake, weights_offloaded (level 1),
                discard_all (level 2); and from the first /sleep, /wake_up or
                /release_kv_cache_memory on, vllm:sleep_mode_operation_duration_seconds and
                vllm:sleep_mode_operations_in_flight by operation (sleep_metrics.py)
    our own     aioserve:event_loop_lag_seconds (how late a coroutine that sleeps
                LAG_PROBE_INTERVAL_S wakes up: time the loop spent blocked),
                aioserve:engine_step_duration_seconds (see `_observe_step_duration`),
                aioserve:host_gap_seconds (how long the model thread waited for the
                host between two model steps: the host work not hidden behind a step)
    speculative with --speculative-config only, as vLLM: vllm:spec_decode_num_drafts_total,
                vllm:spec_decode_num_draft_tokens_total,
                vllm:spec_decode_num_accepted_tokens_total,
                vllm:spec_decode_num_accepted_tokens_per_pos_total{position}

Older names are not exposed. vLLM renamed `vllm:gpu_cache_usage_perc` to
`vllm:kv_cache_usage_perc`, `vllm:gpu_prefix_cache_queries`/`_hits` to
`vllm:prefix_cache_queries`/`_hits`, and `vllm:time_per_output_token_seconds` to
`vllm:inter_token_latency_seconds`; by 0.32 the old names are gone from its /metrics
page, and so a dashboard built for current vLLM finds here exactly what it finds there.
The metrics vLLM itself deprecated (swapped requests, CPU cache, hit-rate gauges,
time_in_queue, model forward/execute times) are not exposed either.

With --enable-lora, `vllm:lora_requests_info{max_lora, running_lora_adapters,
waiting_lora_adapters}` is a gauge as vLLM's: one series per combination of adapters seen,
whose value is when it was last seen (a Unix time). Its labels list the adapters of the
running requests and those of the waiting ones, comma-separated; vLLM 0.32 lists in both
every adapter with a request in flight, running or waiting.

Left out because aioserve cannot measure them (or has no such feature): speculative
decoding (`vllm:spec_decode_*`), multimodal and
external/KV-connector caches (`vllm:mm_cache_*`, `vllm:external_prefix_cache_*`,
`vllm:prompt_tokens_by_source`, `vllm:prompt_tokens_cached*`), waiting
reasons (`vllm:num_requests_waiting_by_reason`) and the HTTP instrumentator (`http_*`).

vLLM's FLOP/byte estimates (`vllm:estimated_*_per_gpu_total`, counting with
--enable-mfu-metrics) and KV-block residency histograms (--kv-cache-metrics) are in
observability_metrics.py.

Where the counting differs from vLLM's: vLLM forks a request with n > 1 into n child
requests and counts each child as one finished request; aioserve counts the user request
once (its token counts summed over its samples). A request with fewer than two output
tokens has no time per output token: vLLM records 0 for it, aioserve records nothing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from aioserve.engine.load_shedding import REASONS, LoadShedder
from aioserve.engine.stats import SpeculationCounts, StepStats
from aioserve.server.bulk_observe import observe_each
from aioserve.server.observability_metrics import ObservabilityMetrics
from aioserve.server.sleep_metrics import EngineSleepState
from aioserve.server.state import ServerState
from aioserve.server.stats_log import engine_stats_line

if TYPE_CHECKING:
    from aioserve.engine.settings import EngineSettings

# vLLM labels every series with its engine index; aioserve runs one engine per process.
ENGINE_INDEX = "0"
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's finish reasons, exposed at 0 from the start so rate() works. Requests ended by
their client are not counted (nor are they in vLLM); "repetition" counts the requests
repetition_detection ended (engine/repetition.py)."""

# Bucket boundaries as vLLM 0.32 uses them (24_metrics.txt).
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
# Ours: under a millisecond on a healthy loop, seconds on a blocked one.
EVENT_LOOP_LAG_BUCKETS = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
]  # fmt: skip
# Ours: from tens of microseconds (the host hidden behind the device) to a blocked host.
HOST_GAP_BUCKETS = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
]  # fmt: skip
# Ours: from a millisecond step on a GPU to the half-second steps of the CPU path.
STEP_DURATION_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
]  # fmt: skip

LAG_PROBE_INTERVAL_S = 0.1
"""How often the event-loop lag monitor wakes up."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


def cache_config_labels(settings: EngineSettings) -> dict[str, str]:
    """The `vllm:cache_config_info` labels aioserve knows, spelled as vLLM spells them."""
    blocks_per_request = math.ceil(settings.max_model_len / settings.block_size)
    return {
        "block_size": str(settings.block_size),
        "enable_prefix_caching": str(settings.enable_prefix_caching),
        "prefix_caching_hash_algo": settings.prefix_caching_hash_algo,
        "num_gpu_blocks": str(settings.num_blocks),
        "kv_cache_size_tokens": str(settings.num_blocks * settings.block_size),
        "kv_cache_max_concurrency": str(settings.num_blocks / blocks_per_request),
    }


class SpeculationCounters:
    """vLLM's speculative-decoding counters (registered only when the engine speculates)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str], positions: int):
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABELS, registry=registry).labels(*labels)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            (*LABELS, "position"),
            registry=registry,
        )
        self.num_accepted_tokens_per_pos = [
            per_pos.labels(*labels, str(position)) for position in range(positions)
        ]

    def record(self, counts: SpeculationCounts) -> None:
        self.num_drafts.inc(counts.num_drafts)
        self.num_draft_tokens.inc(counts.num_draft_tokens)
        self.num_accepted_tokens.inc(counts.num_accepted_tokens)
        for counter, accepted in zip(
            self.num_accepted_tokens_per_pos, counts.num_accepted_tokens_per_pos, strict=True
        ):
            counter.inc(accepted)


class PrometheusStatLogger:
    """Engine statistics as vLLM's Prometheus metrics, on a registry of its own."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        cache_config: Mapping[str, str] | None = None,
        max_loras: int = 0,
        num_speculative_tokens: int = 0,
        custom_buckets: Mapping[str, list[float]] | None = None,
        kv_cache_metrics: bool = False,
    ) -> None:
        """`kv_cache_metrics`: --kv-cache-metrics (observability_metrics.py);
        `max_loras`: --max-loras when LoRA is enabled (0: it is not);
        `num_speculative_tokens`: the drafts a step with speculative decoding (0: none);
        `custom_buckets`: --custom-histogram-buckets, bounds by vLLM's family names."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        labels = (model_name, ENGINE_INDEX)
        registry = self.registry

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, LABELS, registry=registry).labels(*labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABELS, registry=registry).labels(*labels)

        def histogram(name: str, documentation: str, buckets: Iterable[float]) -> Histogram:
            metric = Histogram(name, documentation, LABELS, registry=registry, buckets=buckets)
            return metric.labels(*labels)

        def buckets(family: str, default: list[float]) -> list[float]:
            return list((custom_buckets or {}).get(family, default))

        token_buckets = buckets("request_tokens", build_1_2_5_buckets(max_model_len))
        request_latency = buckets("request_latency", REQUEST_LATENCY_BUCKETS)
        token_latency = buckets("inter_token_latency", TOKEN_LATENCY_BUCKETS)

        self.observability = ObservabilityMetrics(
            registry,
            LABELS,
            labels,
            kv_cache_metrics=kv_cache_metrics,
            custom_buckets=custom_buckets,
        )
        self._max_lora = str(max_loras)
        self.lora_requests_info = None
        if max_loras:
            self.lora_requests_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=registry,
            )
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.speculation = None
        if num_speculative_tokens:
            self.speculation = SpeculationCounters(registry, labels, num_speculative_tokens)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        for reason in FINISH_REASONS:
            self._request_success.labels(*labels, reason)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets("iteration_tokens", ITERATION_TOKENS_BUCKETS),
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets("request_params_n", PARAMS_N_BUCKETS),
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets("time_to_first_token", TTFT_BUCKETS),
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            token_latency,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            token_latency,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            request_latency,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            request_latency,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            request_latency,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            request_latency,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            request_latency,
        )
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            buckets("request_num_preemptions", NUM_PREEMPTIONS_BUCKETS),
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        if cache_config is not None:
            info_labels = dict(cache_config, engine=ENGINE_INDEX)
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                sorted(info_labels),
                registry=registry,
            ).labels(**info_labels).set(1)
        self.engine_step_duration = histogram(
            "aioserve:engine_step_duration_seconds",
            "Histogram of engine step durations in seconds (scheduling, model step and output "
            "processing), measured between consecutive steps while requests were pending.",
            STEP_DURATION_BUCKETS,
        )
        self.host_gap = histogram(
            "aioserve:host_gap_seconds",
            "Histogram of the time the model thread waited for the host between two "
            "consecutive model steps (scheduling, input preparation and output processing "
            "not hidden behind the previous step), in seconds.",
            HOST_GAP_BUCKETS,
        )
        self.event_loop_lag = Histogram(
            "aioserve:event_loop_lag_seconds",
            "Histogram of event-loop lag in seconds: how late a periodic timer fired.",
            ("model_name",),
            registry=registry,
            buckets=EVENT_LOOP_LAG_BUCKETS,
        ).labels(model_name)
        self._last_busy_step_end: float | None = None

    def record(self, stats: StepStats) -> None:
        """Update the metrics with one engine step (or abort)."""
        if self.lora_requests_info is not None and stats.lora_adapters is not None:
            running, waiting = stats.lora_adapters
            self.lora_requests_info.labels(
                self._max_lora, ",".join(running), ",".join(waiting)
            ).set_to_current_time()
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(stats.num_prompt_tokens + stats.num_cached_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if self.speculation is not None and stats.speculation is not None:
            self.speculation.record(stats.speculation)
        if stats.num_tokens > 0:
            self.iteration_tokens.observe(stats.num_tokens)
        observe_each(self.time_to_first_token, stats.time_to_first_tokens)
        observe_each(self.inter_token_latency, stats.inter_token_latencies)
        for request in stats.finished:
            self._request_success.labels(self.model_name, ENGINE_INDEX, request.finish_reason).inc()
            self.request_prompt_tokens.observe(request.num_prompt_tokens)
            self.request_generation_tokens.observe(request.num_generation_tokens)
            self.request_max_num_generation_tokens.observe(request.max_num_generation_tokens)
            self.request_params_n.observe(request.n)
            if request.max_tokens_param is not None:
                self.request_params_max_tokens.observe(request.max_tokens_param)
            self.request_num_preemptions.observe(request.num_preemptions)
            self.request_prefill_kv_computed_tokens.observe(
                max(0, request.num_prompt_tokens - request.num_cached_tokens)
            )
            self.e2e_request_latency.observe(request.e2e_latency)
            self.request_queue_time.observe(request.queued_time)
            self.request_prefill_time.observe(request.prefill_time)
            self.request_decode_time.observe(request.decode_time)
            self.request_inference_time.observe(request.inference_time)
            self.request_time_per_output_token.observe(request.mean_time_per_output_token)
        if stats.host_gap is not None:
            self.host_gap.observe(stats.host_gap)
        self.observability.record(stats)
        self._observe_step_duration(stats)

    def _observe_step_duration(self, stats: StepStats) -> None:
        """Infer the step duration from the engine loop's rhythm, without timing inside it.

        The engine reports each step as it ends, and starts the next step at once while any
        request is pending, so the time between two step reports that had work pending all
        along is one whole step: schedule, prepare, model step, output processing. A report
        without tokens is an abort between steps; when it leaves nothing pending the engine
        goes idle, and the next gap is idle time, not a step.
        """
        pending = stats.num_running + stats.num_waiting > 0
        if stats.num_tokens > 0:
            if self._last_busy_step_end is not None:
                self.engine_step_duration.observe(stats.timestamp - self._last_busy_step_end)
            self._last_busy_step_end = stats.timestamp if pending else None
        elif not pending:
            self._last_busy_step_end = None

    def observe_event_loop_lag(self, seconds: float) -> None:
        """Record how late the lag monitor woke up."""
        self.event_loop_lag.observe(seconds)


class AdmissionRejections:
    """`vllm:admission_rejections_total`, read from the engine's load shedder at each scrape."""

    def __init__(self, model_name: str, shedder: LoadShedder) -> None:
        self.model_name = model_name
        self.shedder = shedder
        self.created = time.time()

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=("model_name", "reason"),
        )
        for reason in REASONS:
            count = self.shedder.rejections[reason]
            family.add_metric((self.model_name, reason), count, created=self.created)
        yield family


async def monitor_event_loop_lag(
    observe: Callable[[float], None], interval: float = LAG_PROBE_INTERVAL_S
) -> None:
    """Sleep `interval` again and again, reporting how much later than asked each wake-up came.

    Anything that holds the event loop (a blocking call, a long synchronous stretch) delays
    the wake-up by as long as it held the loop. Runs until cancelled.
    """
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - started - interval))


METRICS: web.AppKey[PrometheusStatLogger] = web.AppKey("aioserve_metrics", PrometheusStatLogger)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format, the one /metrics serves whatever the scraper's Accept."""


async def serve_metrics(request: web.Request) -> web.Response:
    """GET /metrics: the registry in the Prometheus text format, as vLLM's page is.

    The Accept header is not negotiated: every one Prometheus sends lists this format (and
    `*/*`), and in it the samples keep vLLM's names. prometheus-client's OpenMetrics encoder
    does not keep them: from 0.23 on, for an Accept without `escaping=allow-utf-8` (that of
    Prometheus 2.x, or 3.x set to legacy names) it writes `vllm_num_requests_running`
    samples under `# TYPE vllm:num_requests_running` lines (prometheus/client_python#1177),
    and Prometheus stores the underscore names.
    """
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_metrics(app: web.Application, state: ServerState, *, stats_interval: float | None) -> None:
    """Serve `GET /metrics` and feed it from the engine; log the stats line every
    `stats_interval` seconds (None: not at all).

    The stat loggers join `state.engine.stat_loggers` and the background coroutines (lag
    monitor, stats line) start when the app starts; both are undone on app cleanup.
    """
    engine = state.engine
    speculation = engine.settings.speculation
    num_speculative_tokens = 0 if speculation is None else speculation.num_speculative_tokens
    metrics = PrometheusStatLogger(
        state.model_name,
        max_model_len=engine.settings.max_model_len,
        cache_config=cache_config_labels(engine.settings),
        max_loras=engine.settings.max_loras,
        num_speculative_tokens=num_speculative_tokens,
        custom_buckets=state.frontend.custom_histogram_buckets,
        kv_cache_metrics=engine.settings.observability.kv_cache_metrics_sample is not None,
    )
    metrics.registry.register(AdmissionRejections(state.model_name, engine.load_shedder))
    labels = (state.model_name, ENGINE_INDEX)
    metrics.registry.register(EngineSleepState(LABELS, labels, engine))
    stats_line = None if stats_interval is None else engine_stats_line(engine.settings)
    app[METRICS] = metrics
    app.router.add_get("/metrics", serve_metrics)

    async def observe_engine(app: web.Application):
        loggers = [metrics] if stats_line is None else [metrics, stats_line]
        engine.stat_loggers.extend(loggers)
        tasks = [asyncio.create_task(monitor_event_loop_lag(metrics.observe_event_loop_lag))]
        if stats_line is not None:
            tasks.append(asyncio.create_task(stats_line.run(stats_interval)))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stat_logger in loggers:
            engine.stat_loggers.remove(stat_logger)

    app.cleanup_ctx.append(observe_engine)
