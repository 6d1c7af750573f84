"""/metrics families of vLLM 0.32's ObservabilityConfig flags (part of PrometheusStatLogger).

    counters    vllm:estimated_flops_per_gpu_total, vllm:estimated_read_bytes_per_gpu_total,
                vllm:estimated_write_bytes_per_gpu_total: always on the page, as on vLLM's;
                they count only with --enable-mfu-metrics (engine/step_perf.py).
    histograms  vllm:kv_block_lifetime_seconds, vllm:kv_block_idle_before_evict_seconds,
                vllm:kv_block_reuse_gap_seconds: with --kv-cache-metrics only, as in vLLM,
                on the kv_cache_residency buckets (engine/kv_residency.py).

Each carries `model_name` and `engine`, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from aioserve.engine.stats import StepStats

# vLLM 0.32's KV_CACHE_RESIDENCY_BUCKETS: millisecond reuse gaps to half-hour lifetimes.
KV_CACHE_RESIDENCY_BUCKETS = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
]  # fmt: skip

_SAMPLED = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
_MFU = "(for Model Flops Utilization calculations)."


class ObservabilityMetrics:
    """The FLOP/byte counters and, with --kv-cache-metrics, the residency histograms."""

    def __init__(
        self,
        registry: CollectorRegistry,
        labelnames: tuple[str, ...],
        labels: tuple[str, ...],
        *,
        kv_cache_metrics: bool = False,
        custom_buckets: Mapping[str, list[float]] | None = None,
    ) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labelnames, registry=registry).labels(*labels)

        self.flops = counter(
            "vllm:estimated_flops_per_gpu",
            f"Estimated number of floating point operations per GPU {_MFU}",
        )
        self.read_bytes = counter(
            "vllm:estimated_read_bytes_per_gpu",
            f"Estimated number of bytes read from memory per GPU {_MFU}",
        )
        self.write_bytes = counter(
            "vllm:estimated_write_bytes_per_gpu",
            f"Estimated number of bytes written to memory per GPU {_MFU}",
        )
        self.residency: tuple[Histogram, Histogram, Histogram] | None = None
        if kv_cache_metrics:
            buckets = list(
                (custom_buckets or {}).get("kv_cache_residency", KV_CACHE_RESIDENCY_BUCKETS)
            )

            def histogram(name: str, documentation: str) -> Histogram:
                metric = Histogram(
                    name, documentation, labelnames, registry=registry, buckets=buckets
                )
                return metric.labels(*labels)

            self.residency = (
                histogram(
                    "vllm:kv_block_lifetime_seconds",
                    "Histogram of KV cache block lifetime from allocation to eviction. " + _SAMPLED,
                ),
                histogram(
                    "vllm:kv_block_idle_before_evict_seconds",
                    "Histogram of idle time before KV cache block eviction. " + _SAMPLED,
                ),
                histogram(
                    "vllm:kv_block_reuse_gap_seconds",
                    "Histogram of time gaps between consecutive KV cache block accesses. "
                    "Only the most recent accesses are recorded (ring buffer). " + _SAMPLED,
                ),
            )

    def record(self, stats: StepStats) -> None:
        perf = stats.perf
        if perf is not None and (perf.flops or perf.read_bytes or perf.write_bytes):
            self.flops.inc(perf.flops)
            self.read_bytes.inc(perf.read_bytes)
            self.write_bytes.inc(perf.write_bytes)
        if stats.kv_block_residency and self.residency is not None:
            lifetime, idle, reuse_gap = self.residency
            for sample in stats.kv_block_residency:
                lifetime.observe(sample.lifetime)
                idle.observe(sample.idle)
                for gap in sample.reuse_gaps:
                    reuse_gap.observe(gap)
