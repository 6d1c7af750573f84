"""vLLM 0.32's sleep-mode metrics, under its names, help texts, labels and buckets.

`vllm:engine_sleep_state{sleep_state}` (a gauge on every /metrics page, as vLLM's stat
logger registers it; read from the engine at each scrape): awake 1 while the engine is
awake, else 0, with weights_offloaded 1 after a level-1 sleep or discard_all 1 after a
level-2 one. It changes when vLLM's AsyncLLM records it: after a sleep, after
/release_kv_cache_memory (asleep, level 0) and after a wake that left the engine fully awake.

`vllm:sleep_mode_operation_duration_seconds{operation}` and
`vllm:sleep_mode_operations_in_flight{operation}` time the routes' operations ("sleep",
"release_kv_cache_memory", "wake"); as in vLLM (entrypoints/serve/dev/sleep/metrics.py)
they are registered by the first such call, so a page shows them from then on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from aioserve.engine.async_engine import AsyncEngine

Operation = Literal["sleep", "release_kv_cache_memory", "wake"]
BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)  # vLLM's
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class EngineSleepState:
    """`vllm:engine_sleep_state`, from the engine's last recorded (asleep, level)."""

    def __init__(self, labels: tuple[str, ...], values: tuple[str, ...], engine: AsyncEngine):
        self._labels = (*labels, "sleep_state")
        self._values = values
        self._engine = engine

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            labels=self._labels,
        )
        asleep, level = self._engine.sleep_state
        shown = {
            "awake": float(not asleep),
            "weights_offloaded": float(bool(asleep) and level == 1),
            "discard_all": float(bool(asleep) and level == 2),
        }
        for state in SLEEP_STATES:
            family.add_metric((*self._values, state), shown[state])
        yield family


class SleepOperationMetrics:
    """The routes' operation metrics, registered on `registry` by the first `record`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._metrics: tuple[Histogram, Gauge] | None = None

    def _registered(self) -> tuple[Histogram, Gauge]:
        if self._metrics is None:
            duration = Histogram(
                "vllm:sleep_mode_operation_duration_seconds",
                "Duration of one sleep-mode operation.",
                ["operation"],
                buckets=BUCKETS,
                registry=self._registry,
            )
            in_flight = Gauge(
                "vllm:sleep_mode_operations_in_flight",
                "Sleep-mode operations currently awaited.",
                ["operation"],
                registry=self._registry,
            )
            self._metrics = (duration, in_flight)
        return self._metrics

    @contextmanager
    def record(self, operation: Operation) -> Iterator[None]:
        duration, in_flight = self._registered()
        active = in_flight.labels(operation)
        started = time.perf_counter()
        active.inc()
        try:
            yield
        finally:
            active.dec()
            duration.labels(operation).observe(time.perf_counter() - started)
