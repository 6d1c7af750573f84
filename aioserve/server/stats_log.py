"""The periodic engine stats line, worded as vLLM words it, every 10 seconds (vLLM's
VLLM_LOG_STATS_INTERVAL sets another period: config/frontend.py).

    Engine 000: Avg prompt throughput: 52.3 tokens/s, Avg generation throughput: 104.1
    tokens/s, Running: 4 reqs, Waiting: 0 reqs, CPU KV cache usage: 3.1%, Prefix cache hit
    rate: 12.5%, Host gap: 0.04 ms/step

The last field is aioserve's own: the mean time the model thread waited for the host
between two steps over the interval (`StepStats.host_gap`), appended after vLLM's fields
so that parsers of vLLM's line still read them.

`StatsLine` is a `StatLogger`: the engine feeds it every step; `StatsLine.run` logs the line
every interval it is given. As in vLLM, an idle
server stays quiet: the line goes out at INFO while there is activity and once more after
it stops (with zero throughput), then at DEBUG. The server turns it off with
`--disable-log-stats`. The wording is vLLM's, so that log parsers written for vLLM read it:
"GPU KV cache usage" on a GPU, "CPU KV cache usage" on the CPU, as vLLM-CPU says.

With speculative decoding, a second line follows while sequences drafted, vLLM's too:

    SpecDecoding metrics: Mean acceptance length: 2.53, Accepted throughput: 12.30
    tokens/s, Drafted throughput: 20.10 tokens/s, Accepted: 123 tokens, Drafted: 201
    tokens, Per-position acceptance rate: 0.800, 0.600, 0.400, 0.300, Avg Draft acceptance
    rate: 61.2%

With --enable-mfu-metrics, a line with the estimated FLOPs and memory traffic over the
interval follows, as vLLM's: "Engine 000: MFU: 12.3 TF/s/device 456.7 GB/s/device". With
--enable-logging-iteration-details, every step with tokens is logged at once, as vLLM
logs it: "Engine 000: Iteration(7): 1 context requests, 12 context tokens, 3 generation
requests, 3 generation tokens, iteration elapsed time: 25.31 ms, CPU KV cache usage: 2.0%"
(the time from the step's launch to its result on the host). With --cudagraph-metrics,
vLLM's table of the interval's steps by tokens, padding and CUDA-graph mode follows the
speculative-decoding line (cudagraph_table.py), at the line's level.

Throughputs are averages since the previous line. Running, waiting and KV usage are as of
the latest step. The prefix-cache hit rate is over the lookups of the last
`PREFIX_HIT_RATE_WINDOW` steps that made any (vLLM also reports a recent, not a lifetime,
rate).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from aioserve.engine.stats import StepStats
from aioserve.platform import is_gpu
from aioserve.runner.cudagraph_stats import CUDAGraphSettings
from aioserve.server.cudagraph_table import CUDAGraphTable

if TYPE_CHECKING:
    from aioserve.engine.settings import EngineSettings

logger = logging.getLogger("aioserve.stats")

PREFIX_HIT_RATE_WINDOW = 1000


class StatsLine:
    """Accumulates engine steps and logs vLLM's periodic stats line."""

    def __init__(
        self,
        kv_cache_device: str,
        now: float | None = None,
        cudagraphs: CUDAGraphSettings | None = None,
    ) -> None:
        self._kv_cache_device = kv_cache_device  # "GPU" or "CPU"
        self._last_log_time = time.monotonic() if now is None else now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._latest: StepStats | None = None
        self._lookups: deque[tuple[int, int]] = deque(maxlen=PREFIX_HIT_RATE_WINDOW)
        self._host_gaps = 0.0
        self._num_host_gaps = 0
        self._last_throughputs = (0.0, 0.0)
        self._drafts: list[int] = []  # drafts, draft tokens, accepted, then per position
        self._flops = self._bytes = 0  # --enable-mfu-metrics, since the last line
        # --cudagraph-metrics: the steps since the last line
        self._cudagraphs = None if cudagraphs is None else CUDAGraphTable(cudagraphs)

    def record(self, stats: StepStats) -> None:
        """Count one engine step (or abort) towards the next line."""
        if stats.iteration is not None:
            self._log_iteration(stats)
        if stats.cudagraph is not None and self._cudagraphs is not None:
            self._cudagraphs.observe(stats.cudagraph)
        if stats.perf is not None:
            self._flops += stats.perf.flops
            self._bytes += stats.perf.read_bytes + stats.perf.write_bytes
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        self._latest = stats
        if stats.prefix_cache_queries:
            self._lookups.append((stats.prefix_cache_queries, stats.prefix_cache_hits))
        if stats.host_gap is not None:
            self._host_gaps += stats.host_gap
            self._num_host_gaps += 1
        counts = stats.speculation
        if counts is not None and counts.num_drafts:
            step = [
                counts.num_drafts,
                counts.num_draft_tokens,
                counts.num_accepted_tokens,
                *counts.num_accepted_tokens_per_pos,
            ]
            if self._drafts:
                step = [a + b for a, b in zip(self._drafts, step, strict=True)]
            self._drafts = step

    def log(self, now: float | None = None) -> None:
        """Log the line for the time since the previous one and start a new interval."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_log_time, 1e-9)
        prompt_throughput = self._prompt_tokens / elapsed
        generation_throughput = self._generation_tokens / elapsed
        latest = self._latest
        running = latest.num_running if latest else 0
        waiting = latest.num_waiting if latest else 0
        kv_usage = latest.kv_cache_usage if latest else 0.0
        queries = sum(q for q, _ in self._lookups)
        hit_rate = sum(h for _, h in self._lookups) / queries if queries else 0.0
        active = running or waiting or prompt_throughput or generation_throughput
        level = logging.INFO if active or any(self._last_throughputs) else logging.DEBUG
        logger.log(
            level,
            "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
            "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, %s KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Host gap: %.2f ms/step",
            prompt_throughput,
            generation_throughput,
            running,
            waiting,
            self._kv_cache_device,
            kv_usage * 100,
            hit_rate * 100,
            self._host_gaps / self._num_host_gaps * 1000 if self._num_host_gaps else 0.0,
        )
        if self._drafts:
            self._log_speculation(level, elapsed)
        table = None if self._cudagraphs is None else self._cudagraphs.take()
        if table is not None:
            logger.log(level, "%s", table)
        if self._flops or self._bytes:
            logger.log(
                level,
                "Engine 000: MFU: %.1f TF/s/device %.1f GB/s/device",
                self._flops / elapsed / 1e12,
                self._bytes / elapsed / 1e9,
            )
            self._flops = self._bytes = 0
        self._last_log_time = now
        self._host_gaps, self._num_host_gaps = 0.0, 0
        self._prompt_tokens = self._generation_tokens = 0
        self._last_throughputs = (prompt_throughput, generation_throughput)

    def _log_iteration(self, stats: StepStats) -> None:
        details = stats.iteration
        assert details is not None
        logger.info(
            "Engine 000: Iteration(%d): %d context requests, %d context tokens, %d generation "
            "requests, %d generation tokens, iteration elapsed time: %.2f ms, %s KV cache "
            "usage: %.1f%%",
            details.index,
            details.num_ctx_requests,
            details.num_ctx_tokens,
            details.num_generation_requests,
            details.num_generation_tokens,
            details.elapsed_ms,
            self._kv_cache_device,
            stats.kv_cache_usage * 100,
        )

    def _log_speculation(self, level: int, elapsed: float) -> None:
        drafts, draft_tokens, accepted, *per_position = self._drafts
        self._drafts = []
        logger.log(
            level,
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted / elapsed,
            draft_tokens / elapsed,
            accepted,
            draft_tokens,
            ", ".join(f"{count / drafts:.3f}" for count in per_position),
            accepted / draft_tokens * 100,
        )

    async def run(self, interval: float) -> None:
        """Log the line every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.log()


def engine_stats_line(settings: EngineSettings) -> StatsLine:
    """The server's stats line for an engine: its KV cache's device ("GPU" or "CPU") and,
    with --cudagraph-metrics, the table of its steps."""
    return StatsLine("GPU" if is_gpu() else "CPU", cudagraphs=settings.observability.cudagraphs)
