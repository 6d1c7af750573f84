"""What the engine tells its observers after each step: token counts, queue state, latencies.

The engine builds one `StepStats` after every model step (and after an abort, which can
end requests between steps) and hands it to each registered `StatLogger`. The server's
Prometheus metrics and its periodic log line are such observers; the engine itself knows
nothing about either. Times are seconds from `time.monotonic`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aioserve.engine.kv_cache_manager import KVCacheManager
    from aioserve.engine.kv_residency import ResidencySample
    from aioserve.engine.output_processor import RequestState
    from aioserve.engine.outputs import RequestMetrics
    from aioserve.engine.scheduler import Scheduler, SchedulerStats
    from aioserve.engine.step_observation import IterationDetails, StepObservation
    from aioserve.engine.step_perf import StepPerf
    from aioserve.runner.cudagraph_stats import CUDAGraphStat


@dataclass(frozen=True)
class FinishedRequestStats:
    """One user request that ended (all its n samples), with the phases of its life."""

    finish_reason: str
    """"stop", "length" or "abort"; for n > 1, "abort" if any sample was aborted, else the first's."""
    num_prompt_tokens: int
    num_generation_tokens: int
    """Output tokens of all samples together."""
    max_tokens_param: int | None
    """The request's `max_tokens` as sent (None when it left it out)."""
    max_num_generation_tokens: int
    """The most output tokens one sample generated (vLLM's request_max_num_generation_tokens)."""
    n: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    num_preemptions: int
    e2e_latency: float
    """Arrival to end."""
    queued_time: float
    """Arrival to first scheduled."""
    prefill_time: float
    """First scheduled to first token."""
    decode_time: float
    """First token to last token."""
    inference_time: float
    """First scheduled to last token."""
    mean_time_per_output_token: float
    """decode_time over the tokens after the first; 0 with fewer than two tokens (vLLM's)."""


@dataclass(frozen=True)
class SpeculationCounts:
    """Speculative decoding in one step, as vLLM counts it: the sequences that drafted,
    their drafts, the drafts kept, and per draft position the sequences that kept it."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]


@dataclass(frozen=True)
class StepStats:
    """One engine step (or an abort between steps) and the engine's state after it."""

    timestamp: float
    num_prompt_tokens: int
    """Prompt tokens computed in this step (a preempted prompt counts again when recomputed)."""
    num_generation_tokens: int
    """Tokens sampled in this step and kept as output."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Share of KV blocks in use, 0..1."""
    num_preemptions: int
    """Sequences preempted in this step."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache in this step."""
    prefix_cache_hits: int
    """Of those, the tokens found."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache to the prefills that began in this step:
    with `num_prompt_tokens`, vLLM's prompt tokens (which the iteration tokens leave out)."""
    time_to_first_tokens: list[float] = field(default_factory=list)
    """Arrival to first token, for each request that got its first token in this step."""
    inter_token_latencies: list[float] = field(default_factory=list)
    """Time since the previous token, for each request that got another token."""
    finished: list[FinishedRequestStats] = field(default_factory=list)
    host_gap: float | None = None
    """How long the model thread waited for the host between the previous model step and
    this one (None after an idle spell, and for aborts): the host work not hidden behind
    the device."""
    lora_adapters: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """With LoRA: the adapters of the running requests and those of the waiting ones."""
    speculation: SpeculationCounts | None = None
    """With speculative decoding: what this step drafted and kept (None: no speculation)."""
    kv_block_residency: list[ResidencySample] = field(default_factory=list)
    """--kv-cache-metrics: the sampled blocks evicted since the previous report."""
    perf: StepPerf | None = None
    """--enable-mfu-metrics: the step's estimated FLOPs and bytes."""
    iteration: IterationDetails | None = None
    """--enable-logging-iteration-details: the step's requests, tokens and time."""
    cudagraph: CUDAGraphStat | None = None
    """--cudagraph-metrics: the step's tokens, padded tokens and graph mode."""

    @property
    def num_tokens(self) -> int:
        """Tokens the step ran through the model: vLLM's iteration tokens."""
        return self.num_prompt_tokens + self.num_generation_tokens


@dataclass
class StepTally:
    """What one step did, counted as its outputs are recorded: the figures StepStats takes
    from the step itself."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)

    def count_prompt(self, start: int, num_tokens: int, prompt_len: int, cached: int) -> None:
        """A chunk of num_tokens from position `start` of a sequence whose prompt is
        prompt_len long, `cached` of its tokens found in the prefix cache."""
        if start < prompt_len:
            self.num_prompt_tokens += min(start + num_tokens, prompt_len) - start
            if start == cached:  # the prefill's first chunk
                self.num_cached_prompt_tokens += start

    def count_output(
        self, metrics: RequestMetrics, num_tokens: int, now: float, again: bool
    ) -> None:
        """num_tokens new output tokens of a request (`again`: not its first sequence to get
        some in this step), its latencies updated and counted."""
        self.num_generation_tokens += num_tokens
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.time_to_first_tokens.append(now - metrics.arrival_time)
        elif not again:
            self.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now


class StatLogger(Protocol):
    """An observer of engine steps. `record` runs on the event loop: it must be quick."""

    def record(self, stats: StepStats) -> None: ...


def finished_request_stats(
    state: RequestState, now: float, finish_reason: str | None = None
) -> FinishedRequestStats:
    """The statistics of a request whose samples have all finished at `now`.

    The finish reason is the samples' own ("abort" if any was aborted), unless given:
    "error" for a request ended by a failed model step.
    """
    m = state.metrics
    reasons = [s.finish_reason or "abort" for s in state.samples]
    if finish_reason is None:
        finish_reason = "abort" if "abort" in reasons else reasons[0]
    scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else now
    first_token = m.first_token_time if m.first_token_time is not None else now
    last_token = m.last_token_time if m.last_token_time is not None else first_token
    num_generated = sum(s.request.num_output_tokens for s in state.samples)
    decode_time = last_token - first_token
    per_sample = max(s.request.num_output_tokens for s in state.samples)
    return FinishedRequestStats(
        finish_reason=finish_reason,
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=num_generated,
        max_tokens_param=None if state.pooled is not None else state.params.max_tokens,
        max_num_generation_tokens=per_sample,
        n=len(state.samples),
        num_cached_tokens=state.num_cached_tokens,
        num_preemptions=sum(s.request.num_preemptions for s in state.samples),
        e2e_latency=now - m.arrival_time,
        queued_time=scheduled - m.arrival_time,
        prefill_time=first_token - scheduled,
        decode_time=decode_time,
        inference_time=last_token - scheduled,
        # As vLLM: 0 for a request with no second token (a pooling request has none at all).
        mean_time_per_output_token=decode_time / (per_sample - 1) if per_sample > 1 else 0.0,
    )


class StatsReporter:
    """Builds each step's StepStats from the engine's state and hands it to the loggers.

    `loggers` is the engine's `stat_loggers` list (the server adds and removes its own);
    with none registered, nothing is built."""

    def __init__(self, kv_cache_in_memory: bool = True) -> None:
        self.loggers: list[StatLogger] = []
        # A pooling model's blocks are bookkeeping only: its KV cache usage is 0, as vLLM's.
        self.kv_cache_in_memory = kv_cache_in_memory
        self._finished: list[FinishedRequestStats] = []
        self._counted = (0, 0, 0)  # preemptions, prefix-cache queries and hits reported
        self._counted_speculation = SpeculationCounts(0, 0, 0, ())

    def request_finished(self, state: RequestState, now: float, reason: str | None = None) -> None:
        """Note a request that ended (see finished_request_stats); reported with the next step."""
        if self.loggers:
            self._finished.append(finished_request_stats(state, now, reason))

    def step_done(
        self,
        scheduler: Scheduler,
        kv_cache: KVCacheManager,
        tally: StepTally | None = None,
        host_gap: float | None = None,
        observed: StepObservation | None = None,
    ) -> None:
        """Tell every logger what the last step (`tally`; None for an abort) did, with what
        the observability flags saw of it (`observed`)."""
        if not self.loggers:
            if kv_cache.residency is not None:
                kv_cache.residency.drain()  # unreported, as vLLM's without stat loggers
            return
        tally = tally or StepTally()
        counters = (
            scheduler.stats.num_preemptions,
            kv_cache.stats.queries,
            kv_cache.stats.hits,
        )
        preemptions, queries, hits = (a - b for a, b in zip(counters, self._counted, strict=True))
        self._counted = counters
        stats = StepStats(
            timestamp=time.monotonic(),
            num_prompt_tokens=tally.num_prompt_tokens,
            num_generation_tokens=tally.num_generation_tokens,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv_cache.usage if self.kv_cache_in_memory else 0.0,
            num_preemptions=preemptions,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_cached_prompt_tokens=tally.num_cached_prompt_tokens,
            time_to_first_tokens=tally.time_to_first_tokens,
            inter_token_latencies=tally.inter_token_latencies,
            finished=self._finished,
            host_gap=host_gap,
            lora_adapters=scheduler.lora_adapters() if scheduler.max_loras else None,
            speculation=self._speculation_since(scheduler.stats)
            if scheduler.speculation is not None
            else None,
            perf=None if observed is None else observed.perf,
            iteration=None if observed is None else observed.iteration,
            cudagraph=None if observed is None else observed.cudagraph,
        )
        if kv_cache.residency is not None:
            stats.kv_block_residency.extend(kv_cache.residency.drain())
        self._finished = []
        for stat_logger in self.loggers:
            stat_logger.record(stats)

    def _speculation_since(self, stats: SchedulerStats) -> SpeculationCounts:
        """The scheduler's speculation counts since the last step reported."""
        now = SpeculationCounts(
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            tuple(stats.num_accepted_tokens_per_pos),
        )
        before = self._counted_speculation
        self._counted_speculation = now
        per_pos = before.num_accepted_tokens_per_pos or (0,) * len(now.num_accepted_tokens_per_pos)
        return SpeculationCounts(
            now.num_drafts - before.num_drafts,
            now.num_draft_tokens - before.num_draft_tokens,
            now.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in zip(now.num_accepted_tokens_per_pos, per_pos, strict=True)),
        )
