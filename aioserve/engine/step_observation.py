"""What vLLM 0.32's ObservabilityConfig flags observe of each engine step.

- --enable-logging-iteration-details: per step, its context requests and tokens (sequences
  with no output token yet whose chunk computes prompt tokens: a prompt, or a chunk of a
  chunked prefill), its generation requests and tokens (the others), how long it took and
  the step's index (steps with tokens, from 0); the server's stats logger logs them as
  vLLM's "Iteration(i): ..." line (server/stats_log.py);
- --enable-mfu-metrics: the step's estimated FLOPs and bytes (step_perf.py);
- --cudagraph-metrics: the step's tokens, the size the runner ran them at (a decode padded
  to a graph size) and whether a CUDA graph ran it, as the runner tells it
  (runner/cudagraph_stats.py); the server's stats logger tabulates them;
- --kv-cache-metrics: the block pool's sampled residencies (kv_residency.py), drained with
  each step's statistics.

`StepObserver.launched` looks at a step as it is launched (the scheduler's view of it, as
vLLM's scheduler output, and the runner's prepared step), `finished` once its result is on
the host. With none of these flags the engine has no observer and nothing is computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aioserve.engine.kv_residency import BlockResidencyTracker
from aioserve.engine.step_perf import ModelShape, StepPerf, StepShape
from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat

if TYPE_CHECKING:
    import torch

    from aioserve.config.engine import EngineConfig, ObservabilityConfig
    from aioserve.engine.scheduler import SchedulerOutput
    from aioserve.models.checkpoint import Checkpoint
    from aioserve.runner.model_runner import ModelRunner, PreparedStep
    from aioserve.runner.pooling_runner import PoolingRunner, PreparedPooling


@dataclass(frozen=True)
class ObservabilitySettings:
    """The engine's share of vLLM's ObservabilityConfig."""

    kv_cache_metrics_sample: float | None = None
    """--kv-cache-metrics' sample rate (--kv-cache-metrics-sample); None: off."""
    mfu_model: ModelShape | None = None
    """--enable-mfu-metrics: the model as the FLOP estimate reads it; None: off."""
    iteration_details: bool = False
    """--enable-logging-iteration-details."""
    cudagraphs: CUDAGraphSettings | None = None
    """--cudagraph-metrics: the runner's graph settings, the table's header; None: off."""

    @property
    def observes_steps(self) -> bool:
        return self.mfu_model is not None or self.iteration_details or self.cudagraphs is not None


def observability_settings(
    config: ObservabilityConfig,
    hf_config: object,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    quantization: str | None,
    graphs: CUDAGraphSettings,
) -> ObservabilitySettings:
    """The engine's settings from the flags; the FLOP model read from the config with
    --enable-mfu-metrics only, the runner's `graphs` kept with --cudagraph-metrics only."""
    return ObservabilitySettings(
        kv_cache_metrics_sample=config.kv_cache_metrics_sample if config.kv_cache_metrics else None,
        mfu_model=ModelShape.from_config(hf_config, dtype, kv_cache_dtype, quantization)
        if config.enable_mfu_metrics
        else None,
        iteration_details=config.enable_logging_iteration_details,
        cudagraphs=graphs if config.cudagraph_metrics else None,
    )


def engine_observability(
    config: EngineConfig,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    graphs: CUDAGraphSettings,
) -> ObservabilitySettings:
    """observability_settings for an opened checkpoint and its runner's `graphs`, the
    quantization method named as vLLM names it: --quantization, else the config's
    quantization_config, else "gguf" for a GGUF file (None: not quantized)."""
    method = config.model.quantization
    quant = getattr(checkpoint.hf_config, "quantization_config", None)
    if method is None and quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    if method is None and checkpoint.load_format == "gguf":
        method = "gguf"
    return observability_settings(
        config.observability, checkpoint.hf_config, dtype, kv_cache_dtype, method, graphs
    )


def residency_tracker(settings: ObservabilitySettings) -> BlockResidencyTracker | None:
    """The block pool's residency sampler with --kv-cache-metrics, else None."""
    rate = settings.kv_cache_metrics_sample
    return None if rate is None else BlockResidencyTracker(rate)


@dataclass
class IterationDetails:
    """One step as vLLM's iteration-details line tells it."""

    index: int
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    elapsed_ms: float = 0.0


@dataclass
class StepObservation:
    """What was seen of one step at its launch, completed when it finishes."""

    launched_at: float
    perf: StepPerf | None
    iteration: IterationDetails | None
    cudagraph: CUDAGraphStat | None = None


class StepObserver:
    """Builds each step's StepObservation (only for the flags that are on); the
    runner's, `runner.graph_stat`, with --cudagraph-metrics."""

    def __init__(
        self, settings: ObservabilitySettings, runner: ModelRunner | PoolingRunner
    ) -> None:
        self.model = settings.mfu_model
        self.details = settings.iteration_details
        self.runner = runner if settings.cudagraphs is not None else None
        self._next_index = 0

    def launched(
        self, output: SchedulerOutput, prepared: PreparedStep | PreparedPooling
    ) -> StepObservation:
        perf = None
        if self.model is not None:
            shape = StepShape([])
            for chunk in output.chunks:
                prefill = (
                    chunk.num_computed_tokens < len(chunk.request.prompt_token_ids)
                    or chunk.num_tokens > 1
                )
                shape.add(chunk.num_tokens, chunk.num_computed_tokens + chunk.num_tokens, prefill)
            perf = self.model.estimate(shape)
        iteration = None
        if self.details:
            iteration = IterationDetails(self._next_index, 0, 0, 0, 0)
            self._next_index += 1
            for chunk in output.chunks:
                request = chunk.request
                in_prompt = chunk.num_computed_tokens < len(request.prompt_token_ids)
                if in_prompt and request.num_output_tokens == 0:
                    iteration.num_ctx_requests += 1
                    iteration.num_ctx_tokens += chunk.num_tokens
                else:
                    iteration.num_generation_requests += 1
                    iteration.num_generation_tokens += chunk.num_tokens
        cudagraph = None if self.runner is None else self.runner.graph_stat(prepared)
        return StepObservation(time.monotonic(), perf, iteration, cudagraph)

    @staticmethod
    def finished(observation: StepObservation) -> StepObservation:
        if observation.iteration is not None:
            elapsed = time.monotonic() - observation.launched_at
            observation.iteration.elapsed_ms = elapsed * 1000
        return observation
