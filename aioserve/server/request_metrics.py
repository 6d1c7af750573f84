"""--enable-per-request-metrics: a request's timings in its answer's "metrics", as vLLM 0.32.

    {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
     "tokens_per_second", "speculative_decoding"}

from the engine's timestamps of the request (RequestMetrics, time.monotonic): queued when
the engine took it, first scheduled, first and last output token. As vLLM's
build_per_request_timing_metrics: time to first token runs from the first scheduling to
the first token (queueing left out), generation time from the first token to the last,
queue time from arrival to the first scheduling, the mean inter-token latency is the
generation time over the tokens after the first, and tokens per second are all generated
tokens over the time from the first scheduling to the last token; a figure whose
timestamps are missing is null. `speculative_decoding` is vLLM's per-request
speculation summary (--per-request-spec-decode-metrics, which aioserve does not have):
always null.

vLLM adds them to completions of one prompt and n = 1, chat completions of n = 1 (in a
stream, to the usage chunk only: with stream_options.include_usage or
--enable-force-include-usage), and responses; elsewhere "metrics" stays null (absent from
stream chunks, where vLLM drops null fields).
"""

from __future__ import annotations

from typing import Any

from aioserve.engine.outputs import RequestMetrics


def timing_metrics(metrics: RequestMetrics | None, num_generated_tokens: int) -> dict[str, Any]:
    """vLLM's PerRequestMetrics of a request whose answer has `num_generated_tokens` tokens."""
    ttft = generation = queue = mean_itl = per_second = None
    if metrics is not None:
        scheduled, first, last = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time,
        )
        if scheduled is not None and first is not None:
            ttft = (first - scheduled) * 1000
        if first is not None and last is not None:
            generation = (last - first) * 1000
            if num_generated_tokens > 1:
                mean_itl = generation / (num_generated_tokens - 1)
        if scheduled is not None:
            queue = (scheduled - metrics.arrival_time) * 1000
            if last is not None and last > scheduled:
                per_second = num_generated_tokens / (last - scheduled)
    return {
        "time_to_first_token_ms": ttft,
        "generation_time_ms": generation,
        "queue_time_ms": queue,
        "mean_itl_ms": mean_itl,
        "tokens_per_second": per_second,
        "speculative_decoding": None,
    }
