"""vLLM 0.32's scheduler limits beyond the token budget and the sequence cap, resolved once
the engine knows its budget, sequence cap and context (build.py, pooling_build.py) and
applied by scheduler.py:

- `max_num_scheduled_tokens` (--max-num-scheduled-tokens): the tokens the scheduler issues
  in one step. vLLM keeps two budgets, this one and --max-num-batched-tokens (what the
  runner's buffers hold), each chunk taking from both; they differ only by the draft slots
  of draft-model speculation, and aioserve's n-gram drafts take none (vLLM's
  `max_num_new_slots_for_drafting` is 0 for ngram), so the step's budget is the smaller of
  the two. vLLM refuses no value above --max-num-batched-tokens (the smaller simply wins);
  nor does aioserve.
- `max_num_active_seqs` (--max-num-active-seqs): waiting requests are admitted only while
  fewer run; --max-num-seqs still sizes the runner and its decode graphs.
- `watermark` (--watermark): `int(watermark * num_blocks)` blocks stay free after a waiting
  or preempted request is admitted, if another request runs (vLLM applies it only then:
  the first request must always be able to start). Running sequences never see it.
- `reserve_full_isl` (--scheduler-reserve-full-isl, vLLM's default on): a waiting request
  is admitted only if its whole known sequence (prompt, and output so far when it was
  preempted) fits in the free blocks, its cached prefix shared and the watermark kept; off,
  only its first chunk must fit, which is what aioserve did before this flag existed.
- `adaptive_long_prefill_threshold` (--long-prefill-token-threshold-adaptive): the cap of
  --long-prefill-token-threshold is floored at --max-num-batched-tokens divided by the
  requests running and waiting (`long_prefill_cap`).

vLLM's --prefill-schedule-interval is not here: vLLM reads it only in its data-parallel
MoE engine core (DPEngineCoreProc), so it has no effect on one engine, and aioserve has no
data parallelism; it stays refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioserve.config.engine import SchedulerConfig

logger = logging.getLogger("aioserve")


@dataclass(frozen=True)
class SchedulerLimits:
    """The limits as the scheduler applies them; the defaults are vLLM 0.32's."""

    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    max_num_active_seqs: int | None = None  # None: max_num_seqs
    watermark: float = 0.0
    reserve_full_isl: bool = True
    adaptive_long_prefill_threshold: bool = False


def long_prefill_cap(
    threshold: int, num_requests: int, max_num_batched_tokens: int, adaptive: bool
) -> int:
    """The most tokens one sequence computes in a step (0: no cap), with `num_requests`
    running and waiting: none for a request alone, which starves nobody (vLLM's rule); with
    `adaptive`, at least the requests' fair share of --max-num-batched-tokens."""
    if threshold == 0 or num_requests < 2:
        return 0
    if adaptive:
        return max(threshold, max_num_batched_tokens // num_requests)
    return threshold


def resolve_scheduler_limits(
    scheduler: SchedulerConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    chunked_prefill: bool,
) -> SchedulerLimits:
    """The limits the flags ask for, checked against the resolved budget, sequence cap and
    context; ValueError (naming the flag) for a combination the engine cannot run."""
    active = scheduler.max_num_active_seqs
    if active is not None and active > max_num_seqs:
        raise ValueError(
            f"--max-num-active-seqs ({active}) cannot be greater than --max-num-seqs "
            f"({max_num_seqs})."
        )
    scheduled = scheduler.max_num_scheduled_tokens
    if scheduled is not None and not chunked_prefill and scheduled < max_model_len:
        # vLLM checks only --max-num-batched-tokens here, and would never schedule a prompt
        # longer than this budget: aioserve refuses rather than leave such a request waiting.
        raise ValueError(
            f"--max-num-scheduled-tokens ({scheduled}) is smaller than max_model_len "
            f"({max_model_len}): without chunked prefill a whole prompt must fit in one "
            "step; enable chunked prefill or raise --max-num-scheduled-tokens"
        )
    if scheduler.long_prefill_token_threshold_adaptive and not (
        scheduler.long_prefill_token_threshold
    ):
        logger.warning(
            "--long-prefill-token-threshold-adaptive has no effect without a nonzero "
            "--long-prefill-token-threshold"
        )
    limits = SchedulerLimits(
        max_num_scheduled_tokens=scheduled,
        max_num_active_seqs=active,
        watermark=scheduler.watermark,
        reserve_full_isl=scheduler.scheduler_reserve_full_isl,
        adaptive_long_prefill_threshold=scheduler.long_prefill_token_threshold_adaptive,
    )
    if limits != SchedulerLimits():
        logger.info(
            "scheduler: up to %d tokens a step, %d requests running, %.0f%% of the KV "
            "blocks kept free at admission, whole prompts reserved at admission: %s",
            min(scheduled or max_num_batched_tokens, max_num_batched_tokens),
            active or max_num_seqs,
            100 * limits.watermark,
            "on" if limits.reserve_full_isl else "off",
        )
    return limits
