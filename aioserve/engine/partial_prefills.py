"""Concurrent partial prefills: vLLM's --max-num-partial-prefills and --max-long-partial-prefills.

With chunked prefill and `max_num_partial_prefills` N > 1, several prompts are prefilled
side by side (vLLM V0's scheduler, which runs these flags in vLLM 0.9.2):

- At the start of a step, the prefills that may run in it are counted: running sequences
  still in their prefill, plus the waiting ones that the limits below would let start (in
  any order the count is the same), at most N. Each prefill chunk of the step then takes
  at most `max_num_batched_tokens // count` tokens (the step's budget: a lower
  --max-num-scheduled-tokens divides instead), so that one long prompt does not take
  the whole budget from the prompts beside it.
- At most N sequences are left in the middle of their prefill by a step: a waiting prompt
  whose first chunk would not finish it starts only while fewer are (otherwise the queue
  waits behind it, as when the budget runs out). A prompt that the step prefills whole is
  not a partial prefill and is not held back.
- At most `max_long_partial_prefills` of the step's prefills are long, with more than
  `long_prompt_threshold` tokens still to compute (prefix-cache hits not subtracted, as in
  vLLM): a waiting long prompt beyond that is passed over for this step, keeping its place
  in the queue, and shorter prompts behind it may start.

A sequence "in its prefill" has more than one token to compute: a decode, or a prompt
whose last token alone is left, computes one.

`long_prompt_threshold` is --long-prefill-token-threshold, or 4% of the context when that
is 0 (vLLM's default). Here it only sorts prompts into long and short: the cap on one
sequence's tokens a step stays the explicit --long-prefill-token-threshold's (scheduler.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioserve.engine.request import Request

LONG_PROMPT_FRACTION = 0.04  # of max_model_len: vLLM's long-prompt threshold when none is given


def _tokens_left(request: Request) -> int:
    return request.num_planned_tokens - request.num_computed_tokens


def in_prefill(request: Request) -> bool:
    """Whether the sequence has more than one token to compute."""
    return _tokens_left(request) > 1


@dataclass(frozen=True)
class PartialPrefillLimits:
    """How many prompts are prefilled at once, and how many of them may be long."""

    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prompt_threshold: int  # a prefill with more tokens than this left is long

    def begin_step(
        self, running: Iterable[Request], waiting: Iterable[Request], max_num_batched_tokens: int
    ) -> PrefillStep:
        """The step's share of the budget for each prefill chunk, from the prefills running
        and those of `waiting` that the limits let start."""
        threshold = self.long_prompt_threshold
        num_prefills = num_long = 0
        for request in running:
            left = _tokens_left(request)
            if left > 1:
                num_prefills += 1
                num_long += left > threshold
        long_room = self.max_long_partial_prefills - num_long
        for request in waiting:
            if num_prefills >= self.max_num_partial_prefills:
                break
            left = request.num_planned_tokens  # waiting: nothing computed
            if left <= 1:
                continue
            if left > threshold:
                if long_room <= 0:
                    continue
                long_room -= 1
            num_prefills += 1
        share = max_num_batched_tokens // num_prefills if num_prefills else max_num_batched_tokens
        return PrefillStep(self, max(1, share), num_long)


@dataclass
class PrefillStep:
    """One step's partial-prefill state, as the scheduler fills it in."""

    limits: PartialPrefillLimits
    share: int  # most tokens of one prefill chunk this step
    num_long: int  # long prefills running at the step's start or started in it
    num_partial: int = 0  # sequences left mid-prefill: running ones (count_partial), started ones

    def count_partial(self, running: Iterable[Request]) -> None:
        """Count the running sequences that this step's chunks leave mid-prefill."""
        self.num_partial = sum(1 for request in running if in_prefill(request))

    def is_long(self, request: Request) -> bool:
        """Whether a waiting prompt is long: all its tokens count, cache hits too (vLLM)."""
        return request.num_planned_tokens > self.limits.long_prompt_threshold

    def passes_over(self, request: Request) -> bool:
        """Whether a waiting prompt is long while the long prefills are at their limit."""
        return self.num_long >= self.limits.max_long_partial_prefills and self.is_long(request)

    def may_start(self, request: Request, num_new: int) -> bool:
        """Whether a waiting prompt may start with a chunk of `num_new` tokens (its cache
        hits counted as computed): one the chunk leaves mid-prefill needs a free place."""
        return (
            _tokens_left(request) - num_new <= 1
            or self.num_partial < self.limits.max_num_partial_prefills
        )

    def start(self, request: Request, num_new: int) -> None:
        """Count a prompt that starts with a chunk of `num_new` tokens (called before the
        chunk is counted as computed)."""
        self.num_long += self.is_long(request)
        self.num_partial += _tokens_left(request) - num_new > 1


def partial_prefill_limits(
    max_num_partial_prefills: int,
    max_long_partial_prefills: int,
    long_prefill_token_threshold: int,
    max_model_len: int,
) -> PartialPrefillLimits | None:
    """The limits the flags ask for; None for one partial prefill at a time (the default),
    which leaves scheduling as it is without them."""
    if max_num_partial_prefills <= 1:
        return None
    threshold = long_prefill_token_threshold or int(max_model_len * LONG_PROMPT_FRACTION)
    return PartialPrefillLimits(max_num_partial_prefills, max_long_partial_prefills, threshold)
